"""The sampler's per-call CPU time on a rows x vocab fp32 batch, one thread, for common settings,
and top_p against a full sort of every row (vLLM's way), in the same run.

    python bench/sampler.py
"""

from __future__ import annotations

import time

import torch

from kvserve.engine.sample.sampler import Sampler, SamplingMetadata
from kvserve.engine.sample.sampling_params import SamplingParams


def time_one(sampler: Sampler, logits: torch.Tensor, meta: SamplingMetadata,
             reps: int) -> float:
    """Median CPU time of one call in ms (CPU time, not wall: the machine is shared)."""
    sampler(logits, meta)
    times = []
    for _ in range(reps):
        start = time.process_time()
        sampler(logits, meta)
        times.append(time.process_time() - start)
    return sorted(times)[len(times) // 2] * 1e3


def main(rows: int = 64, vocab: int = 49152, reps: int = 15) -> None:
    """Print the per-call CPU time of a rows x vocab batch for common settings, on one thread."""
    torch.set_num_threads(1)
    logits = torch.randn(rows, vocab) * 3
    prompts = [torch.randint(vocab, (512,)).tolist() for _ in range(rows)]
    outputs = [torch.randint(vocab, (64,)).tolist() for _ in range(rows)]
    full = dict(temperature=0.8, top_k=50, top_p=0.9, min_p=0.05, presence_penalty=0.5,
                frequency_penalty=0.5, repetition_penalty=1.1, seed=1)
    cases = {
        "all greedy": SamplingParams(temperature=0.0),
        "temperature only": SamplingParams(temperature=0.8),
        "temperature + top_k=50": SamplingParams(temperature=0.8, top_k=50),
        "temperature + top_p=0.9": SamplingParams(temperature=0.8, top_p=0.9),
        "penalties only (512 prompt + 64 output ids)": SamplingParams(
            temperature=0.0, presence_penalty=0.5, frequency_penalty=0.5, repetition_penalty=1.1),
        "all of the above + per-row seeds": SamplingParams(**full),
        "all of the above + 5 logprobs": SamplingParams(**full, logprobs=5),
    }
    sampler = Sampler()
    print(f"{rows} x {vocab}, fp32, 1 CPU thread, median CPU ms per call")
    for name, p in cases.items():
        meta = SamplingMetadata.build([p] * rows, prompts, outputs, {}, vocab, "cpu")
        print(f"  {name:45s} {time_one(sampler, logits, meta, reps):8.1f}")
    meta = SamplingMetadata.build(
        [cases["temperature + top_p=0.9"]] * rows, prompts, outputs, {}, vocab, "cpu")
    ours = time_one(sampler, logits, meta, reps)
    peer = time_one(Sampler(top_p_candidates=vocab), logits, meta, reps)  # vLLM's full sort
    print(f"  top_p=0.9: full-sort peer {peer:.1f} ms / ours {ours:.1f} ms = {peer / ours:.1f}x")


if __name__ == "__main__":
    main()
