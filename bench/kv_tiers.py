"""KV memory hierarchy on the default model: tenants whose system prompts together exceed the
device KV pool, served turn by turn (round robin, one request at a time, as interactive chats).

Same run, same requests, up to five engines: `none` (the device pool alone), `host` (the same
pool plus a host tier, kv_offloading_size), `hostsmall` (a host tier smaller than the working
set), `disk` (that small host tier plus a disk tier, kv_offloading_disk_path, in `--disk-path`
or a temporary directory), `unbounded` (a device pool holding every prefix: the hit rate the
tiers should approach). Per engine: prefix hit rate, prompt tokens computed, TTFT p50 /
p90 over the turns after the first round, wall time. Then, from the host engine:

- the swap cost model's rates (copy bytes/s from its offloads and restores, prefill tokens/s
  from its prefill steps) and the crossover (computed tokens per block above which swapping a
  preempted sequence beats recomputing it);
- compression of the host tier's blocks: lz4 (if installed) ratio and (de)compression time per
  block; fp8 e4m3 with one scale per block: ratio, time, and greedy agreement of the later turns
  when every host block is rounded through fp8 before each turn.

    python bench/kv_tiers.py [--tenants 6] [--turns 3] [--system-tokens 384] [--pool-blocks 40]
                             [--device cpu] [--dtype float32] [--threads N]
                             [--configs none,host,unbounded] [--skip-compression]
                             [--small-host-blocks 40] [--disk-gib 1] [--disk-path DIR]

On a CPU shared with other busy processes, `--threads 1` keeps torch's parallel regions from
waiting on descheduled threads (a fixed cost per operator that would hide the prefill saved).
"""

from __future__ import annotations

import argparse
import gc
import statistics
import tempfile
import time

import torch

from workload import SYSTEM_PROMPT, TOPICS  # bench/ is sys.path[0] when run as a script

from kvserve import LLM, SamplingParams
from kvserve.engine.sample.tokenizer import chat_token_ids
from kvserve.engine.worker.model_loader import fetch_model
from kvserve.kernels.fp8 import FP8_DTYPE

PARAMS = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)


def tenant_turns(tokenizer, tenants: int, turns: int, system_tokens: int) -> list[list[int]]:
    """Round-robin turns; each tenant's system prompt is its own (a tenant line first), about
    `system_tokens` long, and each turn asks a new question."""
    prompts = []
    for turn in range(turns):
        for t in range(tenants):
            system = f"Tenant {t} of the support desk. " + (SYSTEM_PROMPT + " ") * 8
            ids = tokenizer(system).input_ids[:system_tokens]
            system = tokenizer.decode(ids)
            q = (f"Turn {turn}: how do {TOPICS[(t + turn) % len(TOPICS)]} and "
                 f"{TOPICS[(3 * t + turn + 1) % len(TOPICS)]} interact?")
            prompts.append(chat_token_ids(tokenizer, [{"role": "system", "content": system},
                                                      {"role": "user", "content": q}]))
    return prompts


def serve_turns(llm: LLM, prompts: list[list[int]], before_turn=None) -> dict:
    engine = llm.llm_engine
    ttft, computed, tokens = [], [], []
    before = engine.get_stats()
    t0 = time.perf_counter()
    for i, ids in enumerate(prompts):
        if before_turn is not None:
            before_turn(i)
        start = time.perf_counter()
        engine.add_request(f"t{i}", ids, PARAMS)
        first, final = None, None
        while engine.has_unfinished_requests():
            for out in engine.step():
                if first is None and out.outputs[0].token_ids:
                    first = time.perf_counter() - start
                final = out
        ttft.append(first)
        computed.append(len(ids) - final.num_cached_tokens)
        tokens.append(final.outputs[0].token_ids)
    after = engine.get_stats()
    hits = {k: getattr(after, k) - getattr(before, k) for k in
            ("prefix_cache_queries", "prefix_cache_hits", "prefix_cache_host_hits",
             "prefix_cache_disk_hits")}
    return {"ttft": ttft, "computed": computed, "tokens": tokens,
            "wall": time.perf_counter() - t0, "hits": hits}


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(int(q * len(xs)), len(xs) - 1)]


def report(name: str, r: dict, first_round: int) -> None:
    h, later = r["hits"], r["ttft"][first_round:]
    queries = h["prefix_cache_queries"] or 1
    rate, host = h["prefix_cache_hits"] / queries, h["prefix_cache_host_hits"] / queries
    disk = h["prefix_cache_disk_hits"] / queries
    print(f"{name:10s} hit rate {rate:6.1%} (host {host:6.1%}, disk {disk:6.1%})  prompt "
          "tokens computed "
          f"{sum(r['computed']):6d}  TTFT later turns p50 {statistics.median(later) * 1e3:7.1f} ms"
          f"  p90 {pct(later, 0.9) * 1e3:7.1f} ms  wall {r['wall']:6.1f} s")


def disk_flush(llm: LLM):
    """Before each turn: the disk writer drained, so the turn's disk hits read files (a
    writer still behind would serve its queued bytes from memory)."""
    disk = llm.llm_engine.disk
    return None if disk is None else (lambda _: disk.flush())


def disk_report(llm: LLM) -> None:
    s, disk = llm.llm_engine.get_stats(), llm.llm_engine.disk
    print(f"           disk tier: {s.disk_blocks_stored} blocks written "
          f"({s.offload_bytes_to_disk / 2**20:.0f} MiB), {s.disk_blocks_restored} loaded "
          f"({s.offload_bytes_from_disk / 2**20:.0f} MiB), {s.disk_blocks_dropped} dropped "
          f"(writer behind), {s.disk_bad_files} bad files, {len(disk)} files now")


def make(model: str, args, **kw) -> LLM:
    return LLM(model, dtype=args.dtype, device=args.device, max_model_len=2048, **kw)


def fp8_roundtrip(block: torch.Tensor) -> torch.Tensor:
    """One scale per block: e4m3 holds |x| <= 448."""
    scale = block.abs().amax().clamp(min=1e-12) / 448.0
    return (block / scale).to(FP8_DTYPE), scale


def compression(host_data: torch.Tensor, slots: list[int]) -> None:
    blocks = [host_data[s].float().contiguous() for s in slots]
    raw = blocks[0].numel() * host_data.element_size()
    print(f"\ncompression of {len(blocks)} host blocks of {raw / 1024:.0f} KiB "
          f"({host_data.dtype}):")
    try:
        import lz4.frame as lz4f
    except ImportError:
        print("  lz4: not installed (pip install lz4)")
    else:
        data = [host_data[s].contiguous().view(torch.uint8).numpy().tobytes() for s in slots]
        t0 = time.perf_counter()
        packed = [lz4f.compress(d) for d in data]
        t1 = time.perf_counter()
        for p in packed:
            lz4f.decompress(p)
        t2 = time.perf_counter()
        ratio = sum(map(len, data)) / sum(map(len, packed))
        print(f"  lz4 frame: ratio {ratio:.3f}x, compress {(t1 - t0) / len(data) * 1e6:.0f} us "
              f"/ block, decompress {(t2 - t1) / len(data) * 1e6:.0f} us / block")
    t0 = time.perf_counter()
    quant = [fp8_roundtrip(b) for b in blocks]
    t1 = time.perf_counter()
    back = [q.float() * s for q, s in quant]
    t2 = time.perf_counter()
    err = max(float(((b - r).abs().max() / b.abs().max().clamp(min=1e-12))) for b, r in
              zip(blocks, back))
    print(f"  fp8 e4m3 per-block scale: ratio {host_data.element_size():.0f}x, quantise "
          f"{(t1 - t0) / len(blocks) * 1e6:.0f} us / block, dequantise "
          f"{(t2 - t1) / len(blocks) * 1e6:.0f} us / block, max error {err:.3%} of the block's max")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--tenants", type=int, default=6)
    p.add_argument("--turns", type=int, default=3)
    p.add_argument("--system-tokens", type=int, default=384)
    p.add_argument("--pool-blocks", type=int, default=40)
    p.add_argument("--host-gib", type=float, default=1.0)
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    p.add_argument("--configs", default="none,host,unbounded")
    p.add_argument("--skip-compression", action="store_true")
    p.add_argument("--small-host-blocks", type=int, default=40,
                   help="host tier blocks of the hostsmall and disk engines")
    p.add_argument("--disk-gib", type=float, default=1.0)
    p.add_argument("--disk-path", default=None, help="disk tier directory (default: a temp one)")
    args = p.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    configs = args.configs.split(",")
    if not {"none", "host"} <= set(configs):
        p.error("--configs needs at least none and host")
    model = str(fetch_model("smollm2-135m-instruct"))
    token_bytes = 30 * 2 * 3 * 64 * torch.finfo(getattr(torch, args.dtype)).bits // 8
    small_host = args.small_host_blocks * 16 * token_bytes / (1 << 30)  # the model's KV layout
    disk_dir = args.disk_path or tempfile.mkdtemp(prefix="kv-disk-")

    results = {}
    for name, kw in (("none", {"num_gpu_blocks_override": args.pool_blocks}),
                     ("host", {"num_gpu_blocks_override": args.pool_blocks,
                               "kv_offloading_size": args.host_gib}),
                     ("hostsmall", {"num_gpu_blocks_override": args.pool_blocks,
                                    "kv_offloading_size": small_host}),
                     ("disk", {"num_gpu_blocks_override": args.pool_blocks,
                               "kv_offloading_size": small_host,
                               "kv_offloading_disk_path": disk_dir,
                               "kv_offloading_disk_size": args.disk_gib}),
                     ("unbounded", {"num_gpu_blocks_override": 8 * args.pool_blocks})):
        if name not in configs:
            continue
        llm = make(model, args, **kw)
        if name == "none":
            prompts = tenant_turns(llm.get_tokenizer(), args.tenants, args.turns,
                                   args.system_tokens)
            working = sum(-(-len(ids) // 16) for ids in prompts[: args.tenants])
            print(f"{len(prompts)} turns, {args.tenants} tenants, prompts "
                  f"{min(map(len, prompts))}..{max(map(len, prompts))} tokens; prefix working "
                  f"set {working} blocks vs a device pool of {args.pool_blocks} "
                  f"({working / args.pool_blocks:.1f}x)")
        serve_turns(llm, prompts[:1])  # warm-up: kernels built, first-call costs paid
        llm.llm_engine.reset_prefix_cache()
        results[name] = serve_turns(llm, prompts, disk_flush(llm))
        report(name, results[name], args.tenants)
        if name == "disk":
            disk_report(llm)
        if name == "host":
            host_llm = llm
        else:
            llm.shutdown()
            del llm
            gc.collect()
    later = slice(args.tenants, None)
    for name in ("host", "hostsmall", "disk"):
        if name not in results:
            continue
        assert results[name]["tokens"] == results["none"]["tokens"], f"{name} changed tokens"
        speed = pct(results["none"]["ttft"][later], 0.9) / pct(results[name]["ttft"][later], 0.9)
        print(f"{name} vs none: TTFT p90 {speed:.2f}x better, prompt tokens computed "
              f"{sum(results[name]['computed'])} vs {sum(results['none']['computed'])}; "
              "tokens identical")

    engine = host_llm.llm_engine
    cost = engine.swap_cost
    cross = cost.crossover_tokens_per_block()
    print(f"\nswap cost model: copy {cost.copy_bytes_per_s / 1e9:.2f} GB/s, prefill "
          f"{cost.prefill_tokens_per_s:.0f} tokens/s, block {cost.bytes_per_block / 1024:.0f} KiB"
          f" -> swap wins above {cross:.3f} computed tokens per block (a block holds "
          f"{engine.block_size})")

    if args.skip_compression:
        return
    host = engine.runner.host
    slots = sorted(engine.kv.host.slots.values())[:64]
    compression(host.data, slots)

    def round_host(_: int) -> None:  # every host block through fp8 before the turn
        for s in engine.kv.host.slots.values():
            q, scale = fp8_roundtrip(host.data[s].float())
            host.data[s] = (q.float() * scale).to(host.data.dtype)

    engine.reset_prefix_cache()
    fp8 = serve_turns(host_llm, prompts, before_turn=round_host)
    ref = results["host"]["tokens"]
    same = sum(a == b for a, b in zip(fp8["tokens"][later], ref[later]))
    agree = [sum(x == y for x, y in zip(a, b)) / len(b) for a, b in
             zip(fp8["tokens"][later], ref[later])]
    print(f"  fp8 host blocks: {same}/{len(ref[later])} later turns greedy-identical, mean "
          f"token agreement {statistics.mean(agree):.1%}")


if __name__ == "__main__":
    main()
