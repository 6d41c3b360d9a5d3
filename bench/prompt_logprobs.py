"""What prompt_logprobs costs the prefill, on the default model.

    python bench/prompt_logprobs.py [--num-prompts 16] [--prompt-words 300] [--repeats 2]

One batch of prompts, one generated token each, prefix caching off (a request asking prompt
logprobs never uses cached blocks, so the peer must not either): prompt tokens per CPU-second
(and per wall second) without prompt logprobs (the peer), with prompt_logprobs=0 (the actual
token's logprob and rank) and with prompt_logprobs=5 (plus the top 5). The difference is the LM
head over every prompt position instead of the last, the log_softmax and the Logprob entries.
Best of --repeats interleaved rounds.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from kvserve import LLM, SamplingParams
from kvserve.engine.config import DEFAULT_MODEL

WORDS = ("the cache keeps keys and values of every token so attention reads them back instead of "
         "computing them again while blocks of sixteen slots hold them like pages").split()


def prompts(n: int, words: int) -> list[str]:
    return [" ".join(WORDS[(i * 7 + j) % len(WORDS)] for j in range(words)) for i in range(n)]


def run(llm: LLM, texts: list[str], k: int | None) -> dict:
    params = SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=k)
    start, cpu_start = time.perf_counter(), time.process_time()
    outs = llm.generate(texts, params, use_tqdm=False)
    wall, cpu = time.perf_counter() - start, time.process_time() - cpu_start
    tokens = sum(len(o.prompt_token_ids) for o in outs)
    if k is not None:
        assert all(len(o.prompt_logprobs) == len(o.prompt_token_ids) for o in outs)
    return {"prompt_logprobs": k, "prompt_tokens": tokens, "seconds": wall,
            "tok_per_s": tokens / wall, "tok_per_cpu_s": tokens / cpu}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=DEFAULT_MODEL)
    ap.add_argument("--num-prompts", type=int, default=16)
    ap.add_argument("--prompt-words", type=int, default=300)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--out", default="bench/results/prompt_logprobs.json")
    args = ap.parse_args()
    llm = LLM(args.model, max_model_len=2048, enable_prefix_caching=False)
    texts = prompts(args.num_prompts, args.prompt_words)
    run(llm, texts[:2], None)  # warm-up
    rounds = [[run(llm, texts, k) for k in (None, 0, 5)] for _ in range(args.repeats)]
    best = [max(runs, key=lambda r: r["tok_per_cpu_s"]) for runs in zip(*rounds)]
    base = best[0]
    for r in best:
        print(f"prompt_logprobs={r['prompt_logprobs']}: {r['prompt_tokens']} prompt tokens, "
              f"{r['tok_per_cpu_s']:.0f} per CPU-s "
              f"({r['tok_per_cpu_s'] / base['tok_per_cpu_s']:.2f}x of none), wall "
              f"{r['tok_per_s']:.0f}/s ({r['tok_per_s'] / base['tok_per_s']:.2f}x)")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"rounds": rounds, "best": best}, indent=2))


if __name__ == "__main__":
    main()
