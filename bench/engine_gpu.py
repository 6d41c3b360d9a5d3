"""End to end on one CUDA GPU: kvserve's engine against HF transformers `generate`, same run.

Random weights of the default model's shape (SmolLM2-135M: 30 layers, 9 query / 3 KV heads,
hidden 576), bf16: no download, so it runs on GPU machines that reach no network. Two workloads,
both greedy with ignore_eos:

  fixed   every request prompt_len tokens in, max_tokens out (HF's best case: no padding waste
          beyond the prompt, every row ends together)
  varied  output lengths drawn from 16..max_tokens (static batching runs each batch to its
          longest member; only the requested tokens count)

HF runs static batches of --hf-batch rows with left padding and SDPA attention; kvserve gets all
requests at once (continuous batching, paged KV, the Triton kernels). Prints output tok/s of each
and the ratio, and how far the greedy tokens agree over the first requests (bf16 rounding on random
weights makes near-ties; agreement is reported, not asserted).

    python bench/engine_gpu.py                    # CUDA, < 3 minutes on an H100/H200
    python bench/engine_gpu.py --smoke            # tiny random model on the CPU: checks the script
"""

from __future__ import annotations

import argparse
import gc
import json
import random
import tempfile
import time
from pathlib import Path

import torch

from tensor_parallel import DEFAULT_SHAPE, TINY_SHAPE, random_model  # bench/ is sys.path[0]


def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def prompts_of(n: int, length: int, vocab: int) -> list[list[int]]:
    rng = random.Random(0)
    return [[rng.randrange(20, vocab) for _ in range(length)] for _ in range(n)]


def run_kvserve(model: Path, args, prompts, lengths, kv_cache_dtype: str = "auto"
                ) -> tuple[float, list[list[int]]]:
    from kvserve import LLM, SamplingParams

    extra = {"kv_cache_memory": 1 << 28} if args.device == "cpu" else {}
    if args.device == "cuda":
        extra = {"gpu_memory_utilization": 0.4}  # two engines fit if one lingers
    llm = LLM(str(model), dtype=args.dtype, device=args.device, max_model_len=args.max_model_len,
              enable_prefix_caching=False, kv_cache_dtype=kv_cache_dtype,
              attention_backend=args.attention_backend, **extra)
    try:
        warm = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
        llm.generate([{"prompt_token_ids": p} for p in prompts[:8]], warm, use_tqdm=False)
        params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in lengths]
        sync(args.device)
        t0 = time.perf_counter()
        if args.profile:
            outs = profiled(args, lambda: llm.generate([{"prompt_token_ids": p} for p in prompts],
                                                       params, use_tqdm=False))
        else:
            outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        sync(args.device)
        dt = time.perf_counter() - t0
    finally:
        llm.shutdown()
        del llm
        gc.collect()  # the next engine sizes its KV cache from free memory: free this one's
        if args.device == "cuda":
            torch.cuda.empty_cache()
    return sum(lengths) / dt, [list(o.outputs[0].token_ids) for o in outs]


def profiled(args, fn):
    """Runs fn under torch.profiler; prints the device's busy share of the wall time and the top
    operators, so a step bound by the host (Python, launches) shows as a low busy share."""
    from torch.profiler import ProfilerActivity, profile

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if args.device == "cuda" else [])
    t0 = time.perf_counter()
    with profile(activities=acts) as prof:
        out = fn()
        sync(args.device)
    wall = time.perf_counter() - t0
    events = prof.key_averages()
    if args.device == "cuda":
        busy = sum(e.self_device_time_total for e in events) / 1e6
        kernels = sum(e.device_time_total and e.count for e in events
                      if e.device_type.name == "CUDA")
        print(f"profile: wall {wall:.2f} s (profiler on), GPU busy {busy:.2f} s = "
              f"{busy / wall:.1%}, {kernels} kernel launches")
        print(events.table(sort_by="self_device_time_total", row_limit=12))
    print(events.table(sort_by="self_cpu_time_total", row_limit=15))
    return out


def run_hf(model: Path, args, prompts, lengths) -> tuple[float, list[list[int]]]:
    from transformers import AutoModelForCausalLM

    dtype = getattr(torch, args.dtype)
    hf = AutoModelForCausalLM.from_pretrained(model, dtype=dtype, attn_implementation="sdpa")
    hf = hf.to(args.device).eval()
    pad = 0

    def batch(chunk, lens):
        width = max(len(p) for p in chunk)
        ids = torch.tensor([[pad] * (width - len(p)) + p for p in chunk], device=args.device)
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in chunk],
                            device=args.device)
        with torch.inference_mode():
            out = hf.generate(input_ids=ids, attention_mask=mask, max_new_tokens=max(lens),
                              min_new_tokens=max(lens), do_sample=False, pad_token_id=pad)
        return [row[width:width + n].tolist() for row, n in zip(out, lens)]

    batch(prompts[:8], [4] * 8)  # warm-up
    sync(args.device)
    t0 = time.perf_counter()
    tokens = []
    for i in range(0, len(prompts), args.hf_batch):
        tokens += batch(prompts[i:i + args.hf_batch], lengths[i:i + args.hf_batch])
    sync(args.device)
    dt = time.perf_counter() - t0
    del hf
    if args.device == "cuda":
        torch.cuda.empty_cache()
    return sum(lengths) / dt, tokens


def agreement(a: list[list[int]], b: list[list[int]]) -> float:
    """Mean share of each sequence's tokens before the first disagreement."""
    shares = []
    for x, y in zip(a, b):
        same = next((i for i, (p, q) in enumerate(zip(x, y)) if p != q), min(len(x), len(y)))
        shares.append(same / max(len(x), 1))
    return sum(shares) / max(len(shares), 1)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--requests", type=int, default=256)
    ap.add_argument("--prompt-len", type=int, default=512)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--hf-batch", type=int, default=64)
    ap.add_argument("--max-model-len", type=int, default=2048)
    ap.add_argument("--attention-backend", default="auto")
    ap.add_argument("--workloads", default="fixed,varied")
    ap.add_argument("--no-fp8", action="store_true", help="skip the fp8 KV run")
    ap.add_argument("--profile", action="store_true", help="torch.profiler over kvserve's runs")
    ap.add_argument("--smoke", action="store_true", help="tiny random model on the CPU")
    args = ap.parse_args()
    shape = DEFAULT_SHAPE
    if args.smoke:
        shape = TINY_SHAPE
        args.device, args.dtype, args.requests, args.prompt_len = "cpu", "float32", 6, 12
        args.max_tokens, args.hf_batch, args.max_model_len = 8, 4, 256
    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("no CUDA GPU visible (use --smoke on a CPU)")
    model = random_model(shape, Path(tempfile.mkdtemp(prefix="kvserve-engine-gpu-")))
    prompts = prompts_of(args.requests, args.prompt_len, min(shape["vocab_size"], 300))
    rng = random.Random(1)
    workloads = {"fixed": [args.max_tokens] * args.requests,
                 "varied": [rng.randint(min(16, args.max_tokens), args.max_tokens)
                            for _ in range(args.requests)]}
    device = torch.cuda.get_device_name() if args.device == "cuda" else "cpu"
    print(f"# {device}, {args.dtype}, {args.requests} requests x {args.prompt_len} prompt "
          f"tokens, HF batch {args.hf_batch}, torch {torch.__version__}")
    results = {}
    for name in args.workloads.split(","):
        lengths = workloads[name]
        kv_tps, kv_tokens = run_kvserve(model, args, prompts, lengths)
        hf_tps, hf_tokens = run_hf(model, args, prompts, lengths)
        if name == "fixed":
            hf_fixed = hf_tokens
        results[name] = {"kvserve_tok_s": round(kv_tps, 1), "hf_tok_s": round(hf_tps, 1),
                         "ratio": round(kv_tps / hf_tps, 2),
                         "greedy_agreement_first16": round(agreement(kv_tokens[:16],
                                                                     hf_tokens[:16]), 3)}
        print(f"{name:7s} kvserve {kv_tps:10.1f} tok/s   HF generate {hf_tps:10.1f} tok/s   "
              f"ratio {kv_tps / hf_tps:5.2f}x   greedy agreement (first 16) "
              f"{results[name]['greedy_agreement_first16']:.3f}")
    if args.no_fp8 or "fixed" not in results:
        print(json.dumps(results))
        return
    # fp8 KV (e4m3, scale 1): half the KV bytes read per decode step; same fixed workload.
    lengths = workloads["fixed"]
    fp8_tps, fp8_tokens = run_kvserve(model, args, prompts, lengths, kv_cache_dtype="fp8")
    results["fixed_fp8_kv"] = {"kvserve_tok_s": round(fp8_tps, 1),
                               "vs_bf16_kv": round(fp8_tps / results["fixed"]["kvserve_tok_s"], 2),
                               "greedy_agreement_first16_vs_hf": round(
                                   agreement(fp8_tokens[:16], hf_fixed[:16]), 3)}
    print(f"fixed, fp8 KV: kvserve {fp8_tps:10.1f} tok/s   vs bf16 KV "
          f"{results['fixed_fp8_kv']['vs_bf16_kv']:.2f}x   greedy agreement with HF (first 16) "
          f"{results['fixed_fp8_kv']['greedy_agreement_first16_vs_hf']:.3f}")
    print(json.dumps(results))


if __name__ == "__main__":
    main()
