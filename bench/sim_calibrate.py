"""Measure the replica simulator's timing model from the real engine on this machine.

    .venv/bin/python bench/sim_calibrate.py            # default model, ~1-2 minutes on 2 cores

Runs `kvserve.LLM` (prefix caching off, so every prompt token is computed) and fits the
simulator's `TimingModel` (service/sim/timing.py):

- prefill seconds per token: the slope between the fastest engine steps prefilling one 256- and
  one 1,024-token prompt (so the fixed cost of a step drops out);
- decode: the fastest of the engine's decode-only steps at batch 1, batch 8 and batch 8 with 8x
  longer contexts, solved for a fixed cost per step, one per sequence and one per context token.

The minimum, not the median, of each timing: other jobs share these 2 cores.

It prints the fitted figures as the keyword arguments of a `TimingModel`, to paste into
`CALIBRATIONS["cpu-smollm2"]` with the machine class and date.
"""

from __future__ import annotations

import argparse
import random
import time

from kvserve import LLM, SamplingParams


def timed(llm: LLM, prompts: list[list[int]], max_tokens: int) -> float:
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True, temperature=0.0)
    t0 = time.perf_counter()
    llm.generate(prompt_token_ids=prompts, sampling_params=params, use_tqdm=False)
    return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--repeats", type=int, default=4, help="best of N for each prefill timing")
    args = ap.parse_args()
    rng = random.Random(0)

    def prompt(n: int) -> list[int]:
        return [rng.randrange(100, 40000) for _ in range(n)]

    llm = LLM(args.model, enable_prefix_caching=False, max_model_len=2048)
    timed(llm, [prompt(64)], 4)  # warm-up: kernels built, allocator warm
    steps = 32
    short, long_ = 256, 1024

    def prefill_time(n: int) -> float:
        """The fastest engine step that prefills one n-token prompt (one request per step, the
        shape warmed first): the minimum, since other jobs share these cores."""
        engine = llm.llm_engine
        params = SamplingParams(max_tokens=1, ignore_eos=True, temperature=0.0)
        times = []
        for i in range(args.repeats + 1):
            engine.add_request(f"p{n}-{i}-{rng.random()}", prompt(n), params)
            t0 = time.perf_counter()
            engine.step()
            times.append(time.perf_counter() - t0)
            while engine.has_unfinished_requests():
                engine.step()
        return min(times[1:])

    t_short, t_long = prefill_time(short), prefill_time(long_)
    prefill = (t_long - t_short) / (long_ - short)

    def decode_time(batch: int, ctx: int) -> float:
        """Median of the engine's own decode-only steps (after every prompt is prefilled)."""
        engine = llm.llm_engine
        params = SamplingParams(max_tokens=steps + 2, ignore_eos=True, temperature=0.0)
        for i in range(batch):
            engine.add_request(f"d{batch}-{ctx}-{i}-{rng.random()}", prompt(ctx), params)
        while engine.get_stats().num_waiting or not engine.get_stats().num_running:
            engine.step()
        engine.step()  # the step that samples the last first token
        times = []
        while engine.has_unfinished_requests():
            t0 = time.perf_counter()
            engine.step()
            times.append(time.perf_counter() - t0)
        return min(times)  # the uncontended step: other jobs share these 2 cores

    d1 = decode_time(1, 64)
    d8 = decode_time(8, 64)
    d8long = decode_time(8, 512)
    per_ctx = max(d8long - d8, 0.0) / (8 * (512 - 64))
    per_seq = max(d8 - d1 - 7 * 64 * per_ctx, 0.0) / 7
    base = max(d1 - per_seq - 64 * per_ctx, 0.0)
    print(f"prefill 256: {t_short * 1e3:.1f} ms, 1024: {t_long * 1e3:.1f} ms")
    print(f"decode step: batch 1 x 64 ctx {d1 * 1e3:.2f} ms, batch 8 x 64 {d8 * 1e3:.2f} ms, "
          f"batch 8 x 512 {d8long * 1e3:.2f} ms")
    print(f"TimingModel(prefill_s_per_token={prefill:.3e}, decode_step_s={base:.3e}, "
          f"decode_s_per_seq={per_seq:.3e}, decode_s_per_ctx_token={per_ctx:.3e})")
    budget = llm.llm_engine.memory_budget
    print(f"KV: {budget.num_blocks} blocks x {budget.block_size} tokens on this machine")


if __name__ == "__main__":
    main()
