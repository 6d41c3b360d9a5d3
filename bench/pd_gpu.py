"""Prefill/decode disaggregation on one GPU: what moving a prompt's KV blocks between two engines'
GPU caches costs (KVServeConnector, engine/kv_transfer/), next to computing them again, at
Llama-3.1-8B's KV layout (32 layers, 8 KV heads x 128, 16-token blocks; bf16 and fp8 caches).

Two engines in one process: a producer connector serves N blocks (N = 1, 8, 32, 128, 512) from a
KV cache on the GPU, a consumer connector pulls them into another GPU KV cache over loopback TCP
and over shared memory: the connector's whole decode-side path (handshake, the producer's
device -> host copy layer by layer into frames or a shared segment, the consumer's host buffer,
confirmation, then LayerLoader's host -> device scatter layer by layer on a side stream), timed
from the scheduler's first ask to the scatter's end (`wire` is the pull thread's fetch alone).
The transports alternate within each round (their order too) after one warm-up round. Every
round's destination blocks are zeroed before the pull and compared with the source byte for byte
after it (other block ids on each side, so a misplaced block shows).

Same run, first: the prefill of the same N x 16 tokens by a random-weight Llama-3.1-8B-shaped
model (kvserve's Llama, bf16, its paged KV cache, the last row's logits), so each transfer row
prints transfer / prefill (the ratio of the medians): the figure that sets the router's
--pd-threshold on a GPU. Should the whole model not fit in the free memory, the prefill runs on
fewer layers, scaled to 32, and the output says so.

Per row: ms per block, median of the rounds (min-max), and GB/s at the median.
`--smoke` (or KV_BENCH_SMOKE=1) runs the same code path at a tiny shape on the CPU.
Usage: bash bench/pd_gpu.sh [--smoke]          # < 5 minutes on an H100
"""

from __future__ import annotations

import gc
import os
import statistics
import sys
import time

import kvserve  # noqa: F401 - before torch: kvserve sets OpenMP's spin for a shared CPU
import torch
from kv_pull import pull
from transformers import LlamaConfig

from kvserve.engine.kv_transfer.config import KVTransferConfig
from kvserve.engine.kv_transfer.factory import EngineInfo, make_connectors
from kvserve.engine.kv_transfer.wire import KVLayout
from kvserve.engine.models.llama import LlamaForCausalLM
from kvserve.engine.spec_decode.draft_kv import DraftKV

SMOKE = os.environ.get("KV_BENCH_SMOKE") == "1" or "--smoke" in sys.argv
DEV = torch.device("cpu" if SMOKE else "cuda")
DTYPE = torch.float32 if SMOKE else torch.bfloat16  # the prefill model's
BLOCK = 16
BLOCKS = (1, 3) if SMOKE else (1, 8, 32, 128, 512)
ROUNDS = 2 if SMOKE else 5
LLAMA_31_8B = dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                   num_attention_heads=32, num_key_value_heads=8, vocab_size=128256,
                   max_position_embeddings=16384, rope_theta=500000.0, rms_norm_eps=1e-5,
                   tie_word_embeddings=False)
TINY = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
            num_key_value_heads=2, vocab_size=512, max_position_embeddings=256,
            tie_word_embeddings=False)
SHAPE = TINY if SMOKE else LLAMA_31_8B
KV_DTYPES = {"bf16": torch.bfloat16, "fp8": torch.float8_e4m3fn}
TRANSPORTS = ("tcp", "shm")


def sync() -> None:
    if DEV.type == "cuda":
        torch.cuda.synchronize()


def spread(values: list[float], scale: float = 1.0) -> str:
    v = sorted(x * scale for x in values)
    return f"{statistics.median(v):.4f} ({v[0]:.4f}-{v[-1]:.4f})"


# ---- prefill ------------------------------------------------------------------------------------
def prefill_layers(config: LlamaConfig) -> int:
    """Layers of the prefill model that fit in the free device memory (all, where they do)."""
    layers = config.num_hidden_layers
    if DEV.type != "cuda":
        return layers
    h, i, v = config.hidden_size, config.intermediate_size, config.vocab_size
    kv_width = config.num_key_value_heads * (h // config.num_attention_heads)
    per_layer = (2 * h * h + 2 * h * kv_width + 3 * h * i) * 2  # bf16 weights
    per_layer += 2 * (max(BLOCKS) + 1) * BLOCK * kv_width * 2  # its paged KV cache
    fixed = 2 * v * h * 2 + (8 << 30)  # embedding, head, activations and headroom
    free = torch.cuda.mem_get_info()[0]
    return max(1, min(layers, (free - fixed) // per_layer))


def time_prefill(config: LlamaConfig) -> tuple[dict[int, list[float]], int]:
    """Per N, seconds of each round's prefill of N x 16 fresh tokens (one sequence, the last
    row's logits), and the layers it ran on."""
    layers = prefill_layers(config)
    cfg = LlamaConfig(**{**SHAPE, "num_hidden_layers": layers})
    model = LlamaForCausalLM(cfg, DTYPE, DEV, max_model_len=max(BLOCKS) * BLOCK + BLOCK)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.fill_(1.0) if "norm" in name else p.normal_(std=0.02)
    model.eval()
    kv = DraftKV(num_layers=layers, num_kv_heads=cfg.num_key_value_heads,
                 head_dim=cfg.hidden_size // cfg.num_attention_heads, dtype=DTYPE, device=DEV,
                 initial_blocks=max(BLOCKS) + 1)
    kv.ensure("s0", max(BLOCKS) * BLOCK)
    gen = torch.Generator().manual_seed(0)

    def once(n: int) -> float:
        ids = torch.randint(100, cfg.vocab_size, (n * BLOCK,), generator=gen).tolist()
        sync()
        t0 = time.perf_counter()
        b = kv.batch(["s0"], [0], [ids])
        hidden = model(b.input_ids, b.positions, kv.kv_caches, b.meta)
        logits = model.compute_logits(hidden[b.last_rows])
        sync()
        assert logits.shape == (1, cfg.vocab_size) and bool(torch.isfinite(logits).all())
        return time.perf_counter() - t0

    out = {}
    with torch.inference_mode():
        for n in BLOCKS:
            once(n)  # warm-up (kernels compiled for this length)
            out[n] = [once(n) for _ in range(ROUNDS)]
    del model, kv
    gc.collect()
    if DEV.type == "cuda":
        torch.cuda.empty_cache()
    return out, layers


# ---- transfer -----------------------------------------------------------------------------------
def layout_for(dtype: torch.dtype) -> KVLayout:
    return KVLayout(model="llama-3.1-8b" if not SMOKE else "tiny",
                    architecture="LlamaForCausalLM", num_layers=SHAPE["num_hidden_layers"],
                    num_kv_heads=SHAPE["num_key_value_heads"],
                    head_dim=SHAPE["hidden_size"] // SHAPE["num_attention_heads"],
                    block_size=BLOCK, kv_dtype=str(dtype), tp_size=1)


def connector(role: str, layout: KVLayout, kv: torch.Tensor, transport: str):
    """(scheduler side, worker side) of one engine's KVServeConnector on `kv`, `[2, layers,
    blocks, block_size, heads, dim]` on the device (what engine_connectors registers)."""
    cfg = KVTransferConfig("KVServeConnector", role, {"kv_port": 0, "transport": transport})
    sched, worker = make_connectors(cfg, EngineInfo(layout, BLOCK, 1, kv.device))
    worker.register_kv_caches({f"layers.{i}": kv[:, i] for i in range(layout.num_layers)})
    return sched, worker


def time_transfers(name: str, dtype: torch.dtype, prefill: dict[int, list[float]],
                   scale: float) -> int:
    """Prints a row per N and transport; the count of rounds whose pulled blocks differed."""
    layout = layout_for(dtype)
    nb = max(BLOCKS) + 1
    shape = (2, layout.num_layers, nb, BLOCK, layout.num_kv_heads, layout.head_dim)
    gen = torch.Generator(device=DEV).manual_seed(1)
    source = torch.randn(shape, device=DEV, generator=gen).to(dtype)
    dest = torch.zeros_like(source)
    src_bytes, dest_bytes = source.view(torch.uint8), dest.view(torch.uint8)  # fp8: no fill
    pairs = {t: (connector("kv_producer", layout, source, t)[0],
                 *connector("kv_consumer", layout, dest, t)) for t in TRANSPORTS}
    per_block = layout.layer_bytes_per_block * layout.num_layers
    bad = 0
    try:
        for n in BLOCKS:
            perm = torch.randperm(nb - 1, generator=torch.Generator().manual_seed(n)) + 1
            src, dst = perm[:n].tolist(), perm.flip(0)[:n].tolist()
            src_i = torch.tensor(src, device=DEV)
            dst_i = torch.tensor(dst, device=DEV)
            times: dict[str, list[float]] = {t: [] for t in TRANSPORTS}
            wire: dict[str, list[float]] = {t: [] for t in TRANSPORTS}
            exact = dict.fromkeys(TRANSPORTS, 0)
            for r in range(ROUNDS + 1):  # round 0 warms up
                for t in (TRANSPORTS if r % 2 else TRANSPORTS[::-1]):
                    p_sched, c_sched, c_worker = pairs[t]
                    dest_bytes.index_fill_(2, dst_i, 0)
                    sync()
                    seconds = pull(p_sched, c_sched, c_worker, src, dst, BLOCK, f"{name}{n}{t}{r}")
                    same = torch.equal(dest_bytes.index_select(2, dst_i),
                                       src_bytes.index_select(2, src_i))
                    exact[t] += same
                    bad += not same
                    if r:
                        times[t].append(seconds)
                        wire[t].append(c_sched.figures.seconds[-1])
            pre = statistics.median(prefill[n]) * scale
            for t in TRANSPORTS:
                med = statistics.median(times[t])
                vs = ""
                if t != "tcp":
                    vs = f"; {t}/tcp {spread([a / b for a, b in zip(times[t], times['tcp'])])}"
                print(f"transfer {name} {n} blocks {t}: {spread(times[t], 1e3 / n)} ms/block, "
                      f"{per_block * n / med / 1e9:.3g} GB/s; wire {spread(wire[t], 1e3 / n)} "
                      f"ms/block{vs}; exact {exact[t]}/{ROUNDS + 1} rounds; transfer/prefill "
                      f"{med / pre:.3f}", flush=True)
        for t, (_, c_sched, _) in pairs.items():
            got = {k for k, v in c_sched.figures.bytes_by_transport.items() if v}
            assert got == {t}, f"asked for {t}, moved over {got}"
    finally:
        for p_sched, c_sched, _ in pairs.values():
            p_sched.shutdown()
            c_sched.shutdown()
    del source, dest, src_bytes, dest_bytes
    if DEV.type == "cuda":
        torch.cuda.empty_cache()
    return bad


def main() -> None:
    t_start = time.perf_counter()
    config = LlamaConfig(**SHAPE)
    lay = layout_for(torch.bfloat16)
    print(f"device {torch.cuda.get_device_name() if DEV.type == 'cuda' else 'cpu (smoke)'}; KV "
          f"layout {'Llama-3.1-8B' if not SMOKE else 'tiny'}: {lay.num_layers} layers, "
          f"{lay.num_kv_heads} KV heads x {lay.head_dim}, block {BLOCK} "
          f"({lay.layer_bytes_per_block * lay.num_layers // 1024} KiB a block in bf16, half in "
          f"fp8); {ROUNDS} rounds after a warm-up; ms/block: median (min-max)", flush=True)
    prefill, layers = time_prefill(config)
    full = config.num_hidden_layers
    scale = full / layers
    if layers == full:
        print(f"prefill model: {layers} of {full} layers, random weights, {DTYPE}", flush=True)
    else:
        print(f"prefill model: {layers} of {full} layers (the whole model does not fit beside "
              f"its KV cache): prefill times scaled by {full}/{layers}", flush=True)
    for n in BLOCKS:
        print(f"prefill {n} blocks ({n * BLOCK} tokens): {spread(prefill[n], 1e3 * scale / n)} "
              f"ms/block", flush=True)
    bad = sum(time_transfers(name, dtype, prefill, scale) for name, dtype in KV_DTYPES.items())
    if bad:
        print(f"MISMATCH: {bad} pulls differ from the source", flush=True)
        sys.exit(1)
    print(f"every pulled block equals its source bit for bit; {time.perf_counter() - t_start:.0f}"
          " s in all", flush=True)


if __name__ == "__main__":
    main()
