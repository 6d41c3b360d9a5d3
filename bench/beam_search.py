"""Beam search (engine/core/beam_group.py) against n independent samples of the same prompt, in
the same run: the peak KV blocks held and the generated tokens per second, widths 1 / 4 / 8.

    python bench/beam_search.py [--model smollm2-135m-instruct] [--prompt 512] [--tokens 32]

Prefix caching is off, so the pool's count is what the running sequences hold; both modes share
the prompt's blocks by reference (beams and n > 1 siblings fork from one prefill)."""

from __future__ import annotations

import argparse
import statistics
import time

from kvserve import LLM, SamplingParams
from kvserve.engine.sample.beam_search import beam_params


def run_once(llm: LLM, prompt: list[int], params: SamplingParams) -> tuple[int, float, float]:
    """(peak blocks held, generated tokens, seconds) of one request run alone."""
    engine = llm.llm_engine
    pool = engine.kv.pool
    before = engine.core.generation_tokens
    start, peak = time.perf_counter(), 0
    engine.add_request("bench", prompt, params)
    while engine.has_unfinished_requests():
        engine.step()
        peak = max(peak, pool.num_blocks - pool.num_free_blocks)
    seconds = time.perf_counter() - start
    return peak, engine.core.generation_tokens - before, seconds


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--prompt", type=int, default=512)
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    llm = LLM(args.model, dtype="float32", enable_prefix_caching=False, max_model_len=2048)
    vocab = llm.llm_engine.vocab_size
    prompt = [(7 * i + 11) % (vocab - 100) + 100 for i in range(args.prompt)]
    modes = {
        "beams": lambda w: beam_params(w, args.tokens, ignore_eos=True),
        "n samples": lambda w: SamplingParams(n=w, temperature=1.0, seed=0,
                                              max_tokens=args.tokens, ignore_eos=True),
    }
    print(f"prompt {args.prompt} tokens ({args.prompt // llm.llm_engine.block_size} blocks), "
          f"{args.tokens} generated, {args.rounds} rounds (median, min-max)")
    print("| width | mode | peak blocks | generated tok/s | spread |")
    print("| --- | --- | --- | --- | --- |")
    for width in (1, 4, 8):
        for name, make in modes.items():
            runs = [run_once(llm, prompt, make(width)) for _ in range(args.rounds + 1)][1:]
            rates = [tokens / s for _, tokens, s in runs]
            print(f"| {width} | {name} | {max(p for p, _, _ in runs)} | "
                  f"{statistics.median(rates):.1f} | {min(rates):.1f}-{max(rates):.1f} |")


if __name__ == "__main__":
    main()
