"""Pipeline parallelism on the CPU: two stages (two processes, each pinned to its own core, one
torch thread each) against one rank pinned to one core, as throughput of one batch of greedy
requests; and what a stage hand-off costs (bytes and time per step, and a gloo ping-pong of the
hand-off tensor between two pinned processes).

    python bench/pipeline_parallel.py --rounds 3          # 8-layer random Llama, M = 1 and 2
    python bench/pipeline_parallel.py --smoke             # tiny model, one round

Each round builds each engine afresh (one torch.distributed group per process), warms it up,
then times `generate` of the same prompts. PP=2 runs with whole steps (KVSERVE_PP_MICROBATCHES
=1: the stages take turns) and with micro-batches (M = 2: stage 0 computes micro-batch 2 while
stage 1 computes micro-batch 1). The greedy tokens of every configuration are checked equal.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import kvserve  # noqa: F401 - before torch: kvserve sets OpenMP's short spin for the ranks
import torch

sys.path.insert(0, str(Path(__file__).parent))
from tensor_parallel import random_model  # noqa: E402 - bench/ is not a package

SHAPE = dict(vocab_size=2048, hidden_size=512, intermediate_size=1536, num_hidden_layers=8,
             num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=1024,
             rms_norm_eps=1e-5, tie_word_embeddings=True)
TINY = dict(SHAPE, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, vocab_size=512)


def prompts(n: int, length: int) -> list[dict]:
    g = torch.Generator().manual_seed(1)
    return [{"prompt_token_ids": torch.randint(3, 290, (length,), generator=g).tolist()}
            for _ in range(n)]


def run(model: Path, pp: int, micro: int, args: argparse.Namespace) -> dict:
    """One engine: (tok/s, tokens, steps, the driver's hand-off figures) of one timed batch."""
    from kvserve import LLM, SamplingParams

    os.environ["KVSERVE_PP_MICROBATCHES"] = str(micro)
    os.sched_setaffinity(0, {args.cpus[0]})
    torch.set_num_threads(1)
    llm = LLM(str(model), dtype="float32", device="cpu", pipeline_parallel_size=pp,
              max_model_len=args.prompt_len + args.max_tokens + 16, kv_cache_memory=48 << 20,
              swap_space=0,
              max_num_seqs=args.requests, enable_prefix_caching=False, seed=0)
    engine = llm.llm_engine
    if pp > 1:  # every thread of the stage-1 process (OpenMP's, gloo's) to the other core
        for proc in engine.runner.workers.procs:
            for tid in os.listdir(f"/proc/{proc.pid}/task"):
                os.sched_setaffinity(int(tid), {args.cpus[1]})
    steps = [0]
    step = engine.step

    def counted():
        steps[0] += 1
        return step()
    engine.step = counted
    try:
        params = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True)
        llm.generate(prompts(2, 8), SamplingParams(temperature=0, max_tokens=4),
                     use_tqdm=False)  # warm-up
        link = engine.runner.link
        before = (link.figures.sends, link.figures.bytes_sent, link.figures.send_s) \
            if link else (0, 0, 0.0)
        steps[0] = 0
        t0 = time.perf_counter()
        outs = llm.generate(prompts(args.requests, args.prompt_len), params, use_tqdm=False)
        elapsed = time.perf_counter() - t0
        tokens = [o.outputs[0].token_ids for o in outs]
        after = (link.figures.sends, link.figures.bytes_sent, link.figures.send_s) \
            if link else (0, 0, 0.0)
    finally:
        llm.shutdown()
    n = sum(len(t) for t in tokens)
    sends, sent, send_s = (a - b for a, b in zip(after, before))
    return {"pp": pp, "microbatches": micro, "tok_s": n / elapsed, "seconds": elapsed,
            "steps": steps[0], "handoffs": sends, "bytes_per_step": sent / max(steps[0], 1),
            "send_ms_per_step": 1e3 * send_s / max(steps[0], 1), "tokens": tokens}


def _pingpong_rank(rank: int, port: int, cpu: int, sizes: list[int], hidden: int,
                   reps: int, out: Path) -> None:
    os.sched_setaffinity(0, {cpu})
    torch.set_num_threads(1)
    torch.distributed.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}",
                                         rank=rank, world_size=2)
    result = {}
    for t in sizes:
        buf = torch.zeros(2, t, hidden)
        times = []
        for _ in range(reps):
            t0 = time.perf_counter()
            if rank == 0:
                torch.distributed.send(buf, 1)
                torch.distributed.recv(buf, 1)
            else:
                torch.distributed.recv(buf, 0)
                torch.distributed.send(buf, 0)
            times.append(time.perf_counter() - t0)
        result[t] = statistics.median(times) / 2  # one way
    if rank == 0:
        out.write_text(json.dumps(result))
    torch.distributed.destroy_process_group()


def pingpong(args: argparse.Namespace, hidden: int) -> dict[int, float]:
    """One-way time of a [2, T, hidden] fp32 hand-off between two pinned processes (gloo)."""
    import multiprocessing
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    out = Path(tempfile.mkdtemp()) / "pingpong.json"
    sizes = [1, 16, 64, 256, 1024]
    ctx = multiprocessing.get_context("spawn")
    procs = [ctx.Process(target=_pingpong_rank, args=(r, port, args.cpus[r], sizes, hidden,
                                                      args.reps, out)) for r in range(2)]
    for p in procs:
        p.start()
    for p in procs:
        p.join()
    return {int(k): v for k, v in json.loads(out.read_text()).items()}


def _gemm_rank(cpu: int, seconds: float, out) -> None:
    os.sched_setaffinity(0, {cpu})
    torch.set_num_threads(1)
    a, b = torch.randn(512, 512), torch.randn(512, 1536)
    t0, n = time.perf_counter(), 0
    while time.perf_counter() - t0 < seconds:
        a @ b
        n += 1
    out.put(n * 2 * 512 * 512 * 1536 / (time.perf_counter() - t0) / 1e9)


def gemm_ceiling(args: argparse.Namespace, seconds: float = 3.0) -> tuple[float, float]:
    """fp32 GEMM GFLOP/s of one pinned process alone, and of two at once on the two cores
    (summed): what two stages can get out of this machine at best, measured in the same run."""
    import multiprocessing

    ctx = multiprocessing.get_context("spawn")
    results = []
    for cpus in ([args.cpus[0]], args.cpus):
        out = ctx.Queue()
        procs = [ctx.Process(target=_gemm_rank, args=(c, seconds, out)) for c in cpus]
        for p in procs:
            p.start()
        results.append(sum(out.get() for _ in procs))
        for p in procs:
            p.join()
    return results[0], results[1]


def spread(values: list[float]) -> str:
    return f"{statistics.median(values):.2f} ({min(values):.2f}-{max(values):.2f})"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--requests", type=int, default=16)
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--reps", type=int, default=200, help="ping-pong repetitions per size")
    ap.add_argument("--cpus", type=int, nargs=2, default=[0, 1], help="the two cores")
    ap.add_argument("--smoke", action="store_true", help="tiny model, one round")
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()
    shape = TINY if args.smoke else SHAPE
    if args.smoke:
        args.rounds, args.requests, args.reps = 1, 4, 10
    model = random_model(shape, Path(tempfile.mkdtemp()) / "model")
    configs = [(1, 1), (2, 1), (2, 2)]
    rows: dict[tuple[int, int], list[dict]] = {c: [] for c in configs}
    ceilings = []
    for _ in range(args.rounds):
        ceilings.append(gemm_ceiling(args, 1.0 if args.smoke else 3.0))
        for pp, micro in configs:
            rows[(pp, micro)].append(run(model, pp, micro, args))
    base = rows[(1, 1)]
    for c in configs[1:]:
        assert all(r["tokens"] == b["tokens"] for r, b in zip(rows[c], base)), \
            f"PP={c[0]} M={c[1]} tokens differ from one rank"
    print(f"model: Llama {shape['num_hidden_layers']} layers, hidden {shape['hidden_size']}, "
          f"fp32; {args.requests} requests x {args.prompt_len} prompt + {args.max_tokens} new "
          f"tokens; {args.rounds} round(s); cores {args.cpus}")
    print("| engine | tok/s median (min-max) | vs PP=1 | steps | hand-off bytes/step | "
          "send ms/step |")
    print("|---|---|---|---|---|---|")
    summary = []
    for (pp, micro), rs in rows.items():
        ratios = [r["tok_s"] / b["tok_s"] for r, b in zip(rs, base)]
        name = "PP=1 (one core)" if pp == 1 else f"PP=2, M={micro} (two cores)"
        print(f"| {name} | {spread([r['tok_s'] for r in rs])} | {spread(ratios)} | "
              f"{rs[0]['steps']} | {rs[0]['bytes_per_step'] / 1024:.1f} KiB | "
              f"{spread([r['send_ms_per_step'] for r in rs])} |")
        summary.append({k: v for k, v in rs[0].items() if k != "tokens"} |
                       {"tok_s_rounds": [r["tok_s"] for r in rs], "ratios": ratios})
    print(f"\nfp32 GEMM (512x512 @ 512x1536), pinned, one thread: one process "
          f"{spread([c[0] for c in ceilings])} GFLOP/s; two at once, summed "
          f"{spread([c[1] for c in ceilings])} GFLOP/s; two / one "
          f"{spread([c[1] / c[0] for c in ceilings])}")
    one_way = pingpong(args, shape["hidden_size"])
    print("\n| tokens per hand-off | bytes | one-way time (gloo, pinned) |\n|---|---|---|")
    for t, s in one_way.items():
        print(f"| {t} | {2 * t * shape['hidden_size'] * 4 / 1024:.1f} KiB | {s * 1e6:.0f} us |")
    if args.json:
        args.json.write_text(json.dumps({"engines": summary, "pingpong_s": one_way,
                                         "gemm_gflops_one_two": ceilings}, indent=1))


if __name__ == "__main__":
    main()
