"""The replica simulator earns its figures: on one small workload the simulated replica and the
real engine (tiny random Llama, same blocks, batch limits and budget) agree exactly on each
request's cached tokens, the preemptions and the number of steps (timing aside); and the
`cpu-smollm2` timing model reproduces the measurements its calibration records."""

from __future__ import annotations

import random
from dataclasses import replace

import looptime
import pytest
from conftest import make_llm

from kvserve import SamplingParams
from kvserve.service.sim.replica import SimReplica
from kvserve.service.sim.timing import TimingModel, timing_model

BS, MAX_SEQS, BUDGET = 16, 8, 2048
_rng = random.Random(0)
_SYSTEM = [_rng.randrange(3, 380) for _ in range(40)]  # a shared 2.5-block system prompt
PROMPTS = [_SYSTEM + [_rng.randrange(3, 380) for _ in range(5 + 3 * i)] for i in range(4)]
MAX_TOKENS = [12, 20, 8, 16]


def engine_run(model_dir, num_blocks: int, preemption_mode: str = "auto"
               ) -> tuple[int, int, dict[str, int]]:
    """(steps, preemptions, cached tokens per request) of the real engine, all requests queued
    at once."""
    llm = make_llm(model_dir, num_gpu_blocks_override=num_blocks, max_num_seqs=MAX_SEQS,
                   max_num_batched_tokens=BUDGET, block_size=BS, preemption_mode=preemption_mode)
    engine = llm.llm_engine
    for i, (p, n) in enumerate(zip(PROMPTS, MAX_TOKENS)):
        engine.add_request(f"r{i}", p, SamplingParams(temperature=0, max_tokens=n,
                                                      ignore_eos=True))
    steps, cached = 0, {}
    while engine.has_unfinished_requests():
        steps += 1
        for out in engine.step():
            if out.finished:
                cached[out.request_id] = out.num_cached_tokens
    return steps, engine.get_stats().num_preemptions, cached


def sim_run(num_blocks: int, preemption_mode: str = "recompute", **timing
            ) -> tuple[int, int, dict[str, int]]:
    """The same for a SimReplica whose every step costs one simulated second, so its busy time
    counts its steps (on looptime's fast-forwarding loop: no wall-clock time passes); swaps
    cost no time, and the CPU pool has room for them all (the engine's 4 GiB default)."""
    unit = TimingModel("unit-steps", prefill_s_per_token=0.0, decode_step_s=1.0,
                       decode_s_per_seq=0.0, decode_s_per_ctx_token=0.0, num_blocks=num_blocks,
                       block_size=BS, max_num_seqs=MAX_SEQS, max_num_batched_tokens=BUDGET,
                       num_cpu_blocks=4 * num_blocks)
    unit = replace(unit, **timing)

    async def main():
        rep = SimReplica("sim", unit, preemption_mode=preemption_mode)
        rep.start()
        try:
            reqs = [rep.submit(f"r{i}", p, n) for i, (p, n) in enumerate(zip(PROMPTS,
                                                                            MAX_TOKENS))]
            for r in reqs:
                while await r.events.get() is not None:
                    pass
            assert all(r.error is None and r.num_output_tokens == r.max_tokens for r in reqs)
            return rep, reqs
        finally:
            await rep.close()

    loop = looptime.new_event_loop(start=0.0)
    try:
        rep, reqs = loop.run_until_complete(main())
    finally:
        loop.close()
    sim_run.counters = rep.counters
    if not timing:
        assert rep.counters.busy_s == int(rep.counters.busy_s)
    return (int(rep.counters.busy_s), rep.counters.preemptions,
            {r.seq.request_id: r.cached_tokens for r in reqs})


def test_the_simulated_replica_steps_and_caches_as_the_engine(tiny_model_dir):
    """A burst of four requests sharing a system prompt: the engine computes the shared blocks
    once (the other three wait one step and hit them); so must the simulator."""
    real = engine_run(tiny_model_dir, 64)
    assert sim_run(64) == real
    steps, preemptions, cached = real
    assert cached == {"r0": 0, "r1": 2 * BS, "r2": 2 * BS, "r3": 2 * BS}
    assert preemptions == 0 and steps == 1 + max(MAX_TOKENS)  # r0 alone, then r1 from step 2


@pytest.mark.parametrize("mode", ["recompute", "swap"])
@pytest.mark.parametrize("num_blocks", [7, 6])
def test_the_simulated_replica_preempts_as_the_engine(tiny_model_dir, num_blocks, mode):
    """A pool too small for the burst: the engine preempts the newest running sequence (no
    admission in that step), by recompute (back at the head of the queue) or by a swap to the
    CPU pool (a swapped sequence comes back before anyone is admitted), and so must the
    simulator, step for step."""
    real = engine_run(tiny_model_dir, num_blocks, preemption_mode=mode)
    assert real[1] >= 1  # the case under test: at least one preemption
    assert sim_run(num_blocks, mode) == real
    assert sim_run.counters.swaps == (real[1] if mode == "swap" else 0)


def test_auto_preemption_follows_the_timing_models_cost():
    """"auto" swaps where copying a sequence's blocks out and back costs less than recomputing
    its tokens (the engine's SwapCostModel rule on the model's rates), else recomputes; the runs
    then equal the "swap" and "recompute" runs' preemptions and cached tokens."""
    cheap_copy = dict(prefill_s_per_token=1e-3, swap_s_per_block=1e-5)
    dear_copy = dict(prefill_s_per_token=1e-3, swap_s_per_block=1.0)
    swap, recompute = sim_run(6, "swap", **cheap_copy), sim_run(6, "recompute", **cheap_copy)
    assert swap[1:] != recompute[1:] or swap[0] != recompute[0]
    assert sim_run(6, "auto", **cheap_copy)[1:] == swap[1:]
    assert sim_run.counters.swaps == swap[1] >= 1
    assert sim_run(6, "auto", **dear_copy)[1:] == sim_run(6, "recompute", **dear_copy)[1:]
    assert sim_run.counters.swaps == 0
    m = TimingModel("m", 1e-3, 1.0, 0.0, 0.0, num_blocks=8, swap_s_per_block=5e-3)
    assert m.prefer_swap(1, 16) and not m.prefer_swap(2, 16)  # 10 ms < 16 ms; 20 ms > 16 ms


# What bench/sim_calibrate.py measured on SPR, 2 cores (service/sim/timing.py's comment), as
# (prefill tokens, decoding sequences, context tokens) -> seconds of one engine step.
CPU_SMOLLM2_DECODE = {(0, 1, 64): 31.5e-3, (0, 8, 8 * 64): 42.0e-3}
CPU_SMOLLM2_PREFILL = {(256, 0, 0): 101.0e-3, (1024, 0, 0): 290.7e-3}
TOLERANCE = 0.05  # the model's fit against the points it was fitted to
PREFILL_TOLERANCE = 0.10  # a fixed cost + a slope through two points, the fixed cost the decode's


def test_the_cpu_timing_model_reproduces_its_calibration():
    m = timing_model("cpu-smollm2")
    for (prefill, seqs, context), seconds in CPU_SMOLLM2_DECODE.items():
        assert m.step_seconds(prefill, seqs, context) == pytest.approx(seconds, rel=TOLERANCE)
    # Prefill was fitted as the slope between one 256- and one 1,024-token prompt's steps, so
    # the fixed cost of a step drops out of it; the points themselves hold within 10%
    slope = (m.step_seconds(1024, 0, 0) - m.step_seconds(256, 0, 0)) / (1024 - 256)
    assert slope == pytest.approx((0.2907 - 0.1010) / (1024 - 256), rel=TOLERANCE)
    for (prefill, seqs, context), seconds in CPU_SMOLLM2_PREFILL.items():
        assert m.step_seconds(prefill, seqs, context) == pytest.approx(seconds,
                                                                       rel=PREFILL_TOLERANCE)
