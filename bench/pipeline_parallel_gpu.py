"""Pipeline parallelism on one GPU: two stages in two processes sharing the device against one
rank, as throughput of one batch of greedy requests, and the hand-off's cost.

    python bench/pipeline_parallel_gpu.py                     # default model's shape, bf16
    python bench/pipeline_parallel_gpu.py --layers 8 --rounds 5

Two ranks cannot share a GPU under NCCL (it refuses a duplicate device), so the two stages run
with KVSERVE_RANK_DEVICES=0,0 over gloo, each hand-off staged through host memory (D2H, a local
TCP send, H2D): an upper bound on what NCCL between two GPUs of one node costs, and a measure of
whether micro-batches (M = 2) overlap the stages on one device (two CUDA contexts time-slice the
SMs, so the ceiling is one rank's throughput; the figure shows the pipeline's overhead). The
greedy tokens of every configuration are compared with one rank's (bf16: reported, not
asserted). Prints a markdown table; --json writes the figures.
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

import kvserve  # noqa: F401 - before torch
import torch

sys.path.insert(0, str(Path(__file__).parent))
from tensor_parallel import DEFAULT_SHAPE, random_model  # noqa: E402 - bench/ is no package


def run(model: Path, pp: int, micro: int, args: argparse.Namespace) -> dict:
    from kvserve import LLM, SamplingParams

    os.environ["KVSERVE_PP_MICROBATCHES"] = str(micro)
    if pp > 1:
        os.environ["KVSERVE_RANK_DEVICES"] = ",".join(["0"] * pp)
    llm = LLM(str(model), dtype=args.dtype, device="cuda", pipeline_parallel_size=pp,
              max_model_len=args.prompt_len + args.max_tokens + 16,
              gpu_memory_utilization=0.4 / pp, max_num_seqs=args.requests,
              enable_prefix_caching=False, enforce_eager=True, seed=0)
    engine = llm.llm_engine
    g = torch.Generator().manual_seed(1)
    prompts = [{"prompt_token_ids": torch.randint(3, 290, (args.prompt_len,),
                                                  generator=g).tolist()}
               for _ in range(args.requests)]
    try:
        params = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True)
        llm.generate(prompts[:2], SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)
        link = engine.runner.link
        before = (link.figures.sends, link.figures.bytes_sent, link.figures.send_s) \
            if link else (0, 0, 0.0)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        outs = llm.generate(prompts, params, use_tqdm=False)
        elapsed = time.perf_counter() - t0
        after = (link.figures.sends, link.figures.bytes_sent, link.figures.send_s) \
            if link else (0, 0, 0.0)
    finally:
        llm.shutdown()
        os.environ.pop("KVSERVE_RANK_DEVICES", None)
    tokens = [o.outputs[0].token_ids for o in outs]
    sends, sent, send_s = (a - b for a, b in zip(after, before))
    return {"pp": pp, "microbatches": micro, "tok_s": sum(map(len, tokens)) / elapsed,
            "handoffs": sends, "bytes_per_handoff": sent / max(sends, 1),
            "send_ms_per_handoff": 1e3 * send_s / max(sends, 1), "tokens": tokens}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--prompt-len", type=int, default=256)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--layers", type=int, default=DEFAULT_SHAPE["num_hidden_layers"])
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("no CUDA device: this script measures pipeline stages on a GPU")
    model = random_model(dict(DEFAULT_SHAPE, num_hidden_layers=args.layers),
                         Path(tempfile.mkdtemp()) / "model")
    configs = [(1, 1), (2, 1), (2, 2)]
    rows: dict[tuple[int, int], list[dict]] = {c: [] for c in configs}
    for _ in range(args.rounds):
        for pp, micro in configs:
            rows[(pp, micro)].append(run(model, pp, micro, args))
    base = rows[(1, 1)]
    print(f"{torch.cuda.get_device_name()}; Llama {args.layers} layers, hidden "
          f"{DEFAULT_SHAPE['hidden_size']}, {args.dtype}; {args.requests} requests x "
          f"{args.prompt_len} + {args.max_tokens} tokens; {args.rounds} rounds")
    print("| engine | tok/s median (min-max) | vs PP=1 | hand-off KiB | send ms/hand-off | "
          "tokens equal PP=1 |\n|---|---|---|---|---|---|")
    summary = []
    for (pp, micro), rs in rows.items():
        tps = [r["tok_s"] for r in rs]
        ratios = [r["tok_s"] / b["tok_s"] for r, b in zip(rs, base)]
        same = sum(r["tokens"] == b["tokens"] for r, b in zip(rs, base))
        sends = [r["send_ms_per_handoff"] for r in rs]
        print(f"| PP={pp} M={micro} | {statistics.median(tps):.0f} ({min(tps):.0f}-"
              f"{max(tps):.0f}) | {statistics.median(ratios):.2f} | "
              f"{rs[0]['bytes_per_handoff'] / 1024:.0f} | {statistics.median(sends):.2f} | "
              f"{same}/{len(rs)} |")
        summary.append({k: v for k, v in rs[0].items() if k != "tokens"} |
                       {"tok_s_rounds": tps, "ratios": ratios})
    if args.json:
        args.json.write_text(json.dumps(summary, indent=1))


if __name__ == "__main__":
    main()
