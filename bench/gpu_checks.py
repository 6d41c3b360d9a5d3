"""Engine paths that only a CUDA device exercises, checked in one short run on a lent GPU:

  host tier   evicted prefix blocks offloaded to pinned host memory on a side stream and restored
              on a hit: outputs equal an engine without the tier, host hits counted
  swap        preemption by swapping to the CPU pool (explicit and `auto`): outputs equal an
              engine whose pool never preempts
  fp32        an fp32 model through the Triton kernels: greedy tokens equal the torch backend's

Random weights of the default model's shape (no download), greedy, token-id prompts. Prints one
line per check with PASS/FAIL and the counts behind it; exits 1 if any check fails.

    python bench/gpu_checks.py               # CUDA
    python bench/gpu_checks.py --smoke       # tiny random model on the CPU: checks the script
"""

from __future__ import annotations

import argparse
import gc
import random
import sys
import tempfile
from pathlib import Path

import torch

from tensor_parallel import DEFAULT_SHAPE, TINY_SHAPE, random_model  # bench/ is sys.path[0]

from kvserve import LLM, SamplingParams

GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)


def engine(model: Path, args, **kw) -> LLM:
    kw.setdefault("dtype", args.dtype)
    if args.device == "cpu":
        kw.setdefault("kv_cache_memory", 1 << 26)
    else:  # a small share: an engine not yet collected must not starve the next one
        kw.setdefault("gpu_memory_utilization", 0.2)
    return LLM(str(model), device=args.device, max_model_len=512, **kw)


def close(llm: LLM) -> None:
    llm.shutdown()
    del llm
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def run(llm: LLM, prompts: list[list[int]], one_by_one: bool) -> list[list[int]]:
    batches = [[p] for p in prompts] if one_by_one else [prompts]
    out = []
    for batch in batches:
        res = llm.generate([{"prompt_token_ids": p} for p in batch], GREEDY, use_tqdm=False)
        out += [list(r.outputs[0].token_ids) for r in res]
    return out


def tenants(n: int, system: int, vocab: int) -> list[list[int]]:
    """Turn-by-turn chats: each tenant a long shared prefix plus a short question per turn."""
    rng = random.Random(0)
    prefixes = [[rng.randrange(20, vocab) for _ in range(system)] for _ in range(n)]
    return [prefixes[t] + [rng.randrange(20, vocab) for _ in range(12)]
            for _ in range(3) for t in range(n)]


def check_host_tier(model: Path, args, vocab: int) -> bool:
    prompts = tenants(6, 256, vocab)  # 6 x 16 prefix blocks against a 48-block pool
    base = engine(model, args, num_gpu_blocks_override=48)
    want = run(base, prompts, one_by_one=True)
    close(base)
    tier = engine(model, args, num_gpu_blocks_override=48, kv_offloading_size=0.25)
    got = run(tier, prompts, one_by_one=True)
    hits = tier.llm_engine.get_stats().prefix_cache_host_hits
    close(tier)
    ok = got == want and hits > 0
    print(f"host tier  {'PASS' if ok else 'FAIL'}  identical {got == want}, host-restored prompt "
          f"tokens {hits}")
    return ok


def check_swap(model: Path, args, vocab: int) -> bool:
    rng = random.Random(1)
    prompts = [[rng.randrange(20, vocab) for _ in range(200)] for _ in range(12)]
    roomy = engine(model, args, enable_prefix_caching=False)
    want = run(roomy, prompts, one_by_one=False)
    close(roomy)
    ok = True
    for mode in ("swap", "auto"):
        tight = engine(model, args, enable_prefix_caching=False, num_gpu_blocks_override=40,
                       preemption_mode=mode, swap_space=0.5)
        got = run(tight, prompts, one_by_one=False)
        pre = tight.llm_engine.get_stats().num_preemptions
        close(tight)
        ok &= got == want and pre > 0
        print(f"swap/{mode:4s} {'PASS' if got == want and pre > 0 else 'FAIL'}  identical "
              f"{got == want}, preemptions {pre}")
    return ok


def check_fp32(model: Path, args, vocab: int) -> bool:
    rng = random.Random(2)
    prompts = [[rng.randrange(20, vocab) for _ in range(rng.randint(30, 300))] for _ in range(8)]
    outs = {}
    for backend in ("torch", "triton"):
        llm = engine(model, args, dtype="float32", attention_backend=backend,
                     enable_prefix_caching=False)
        outs[backend] = run(llm, prompts, one_by_one=False)
        close(llm)
    same = sum(a == b for a, b in zip(outs["torch"], outs["triton"]))
    ok = same == len(prompts)
    print(f"fp32       {'PASS' if ok else 'FAIL'}  triton == torch backend for {same}/{len(prompts)}"
          " sequences")
    return ok


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--device", default="cuda")
    # fp32: the checks compare engines whose batches differ in shape, and bf16 rounding of a
    # random-weight model flips near-tied greedy tokens between any two shapes
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--checks", default="host_tier,swap,fp32")
    ap.add_argument("--smoke", action="store_true")
    args = ap.parse_args()
    shape = DEFAULT_SHAPE
    if args.smoke:
        shape, args.device, args.dtype = TINY_SHAPE, "cpu", "float32"
        args.checks = "host_tier,swap"  # the Triton backend needs a GPU or the interpreter
    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("no CUDA GPU visible (use --smoke on a CPU)")
    model = random_model(shape, Path(tempfile.mkdtemp(prefix="kvserve-gpu-checks-")))
    vocab = min(shape["vocab_size"], 300)
    checks = {"host_tier": check_host_tier, "swap": check_swap, "fp32": check_fp32}
    results = [checks[name](model, args, vocab) for name in args.checks.split(",")]
    sys.exit(0 if all(results) else 1)


if __name__ == "__main__":
    main()
