"""The replica simulator's timing model and KV accounting (service/sim/), no Redis, no HTTP."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import TypeVar

import looptime
import pytest
from kvserve.engine.core.block_hash import block_hashes_bytes
from kvserve.service.sim.replica import CapacityError, SimReplica
from kvserve.service.sim.timing import CALIBRATIONS, TimingModel, timing_model

# Fast enough for a unit test: a 64-token prompt prefills in 6.4 ms, a decode step is ~1 ms.
FAST = TimingModel("test", prefill_s_per_token=1e-4, decode_step_s=1e-3, decode_s_per_seq=1e-4,
                   decode_s_per_ctx_token=1e-7, num_blocks=64, block_size=16, max_num_seqs=8,
                   max_num_batched_tokens=256)


T = TypeVar("T")


def in_sim_time(main: Callable[[], Awaitable[T]]) -> T:
    """Run `main()` on an event loop whose clock only sleeps and timeouts advance (looptime's
    fast-forwarding loop, from 0): the replica's timings are then exact simulated seconds,
    whatever the CPU's speed or load."""
    loop = looptime.new_event_loop(start=0.0)
    try:
        return loop.run_until_complete(main())
    finally:
        loop.close()


def prompt(tag: int, n: int = 64) -> list[int]:
    return [(tag * 7919 + i) % 30000 + 1 for i in range(n)]


async def run(replica: SimReplica, prompts: list[list[int]], max_tokens: int = 4) -> list:
    reqs = [replica.submit(f"r{i}", p, max_tokens) for i, p in enumerate(prompts)]
    for r in reqs:
        while await r.events.get() is not None:
            pass
    return reqs


def test_decode_step_grows_with_batch_and_context():
    m = timing_model("h100-llama3-8b")
    assert m.step_seconds(0, 64, 64 * 2048) > m.step_seconds(0, 8, 8 * 2048) > \
        m.step_seconds(0, 1, 2048) > 0
    assert m.step_seconds(0, 8, 8 * 8192) > m.step_seconds(0, 8, 8 * 1024)
    assert m.step_seconds(0, 0, 0) == 0.0
    # prefill is paid per uncached token
    assert m.step_seconds(4096, 0, 0) - m.step_seconds(2048, 0, 0) == \
        pytest.approx(2048 * m.prefill_s_per_token)


def test_calibrations_are_named_and_scaled():
    assert set(CALIBRATIONS) == {"cpu-smollm2", "h100-llama3-8b"}
    gpu = timing_model("h100-llama3-8b")
    assert 15_000 < 1 / gpu.prefill_s_per_token < 60_000  # tokens/s of an 8B model's prefill
    assert 3e-3 < gpu.decode_step_s < 1e-2
    assert gpu.num_blocks * gpu.block_size > 200_000  # an 80 GB card holds ~400k tokens of KV
    slow = gpu.scaled(10.0, num_blocks=100)
    assert slow.prefill_s_per_token == pytest.approx(10 * gpu.prefill_s_per_token)
    assert slow.num_blocks == 100
    with pytest.raises(ValueError, match="unknown timing model 'tpu'"):
        timing_model("tpu")
    with pytest.raises(ValueError, match="num_blocks"):
        TimingModel("bad", 1e-4, 1e-3, 0, 0, num_blocks=0)


def test_repeated_prompt_becomes_a_hit():
    async def main():
        rep = SimReplica("a", FAST)
        rep.start()
        try:
            return rep, *await run(rep, [prompt(1, 100)]), *await run(rep, [prompt(1, 100)])
        finally:
            await rep.close()

    rep, first, second = in_sim_time(main)
    assert first.cached_tokens == 0
    assert second.cached_tokens == 96  # 6 full blocks of 100 tokens (one token left to compute)
    assert rep.counters.prompt_tokens == 200 and rep.counters.cached_tokens == 96
    assert first.num_output_tokens == 4 and second.num_output_tokens == 4
    # the hit costs less prefill: one step of 100 prompt tokens, then one of 4 (simulated s)
    assert first.first_token_at - first.arrival == pytest.approx(FAST.step_seconds(100, 0, 0))
    assert second.first_token_at - second.arrival == pytest.approx(FAST.step_seconds(4, 0, 0))
    hashes = block_hashes_bytes(prompt(1, 100), 16)
    assert rep.cached_prefix_blocks(hashes) == 6
    assert rep.cached_prefix_blocks(block_hashes_bytes(prompt(2, 100), 16)) == 0


async def test_lru_eviction_under_capacity_pressure():
    rep = SimReplica("a", FAST)  # 64 blocks: room for ~12 prompts of 5 blocks at most
    rep.start()
    try:
        await run(rep, [prompt(0, 80)])
        await run(rep, [prompt(t, 80) for t in range(1, 20)])  # 19 other prompts
        again, = await run(rep, [prompt(0, 80)])
        recent, = await run(rep, [prompt(19, 80)])
    finally:
        await rep.close()
    assert again.cached_tokens == 0  # the oldest prompt was evicted
    assert recent.cached_tokens == 64  # the newest one is still there
    assert rep.kv.pool.num_evictions > 0


async def test_continuous_batching_and_preemption_finish_everything():
    tight = TimingModel("tight", 1e-5, 1e-4, 1e-5, 0.0, num_blocks=12, block_size=16,
                        max_num_seqs=8, max_num_batched_tokens=64)
    rep = SimReplica("a", tight)
    rep.start()
    try:
        reqs = await asyncio.wait_for(run(rep, [prompt(t, 40) for t in range(6)], 40), 10)
    finally:
        await rep.close()
    assert all(r.error is None and r.num_output_tokens == 40 for r in reqs)
    assert rep.counters.preemptions > 0  # 6 x 5 blocks at the end > 12: someone was preempted
    assert rep.kv.num_free_blocks == 12  # nothing leaked


async def test_prompt_larger_than_the_pool_is_refused():
    rep = SimReplica("a", FAST)
    with pytest.raises(CapacityError, match="64"):
        rep.submit("big", prompt(0, 2000), 4)


async def test_decode_time_grows_with_batch_in_the_simulation():
    """Eight concurrent requests take longer per token than one (the batch's step is slower)."""
    slow_decode = TimingModel("d", 1e-6, 2e-3, 2e-3, 0.0, num_blocks=256, block_size=16,
                              max_num_seqs=16, max_num_batched_tokens=512)

    async def per_token(n: int) -> float:
        rep = SimReplica("a", slow_decode)
        rep.start()
        try:
            reqs = await run(rep, [prompt(t, 32) for t in range(n)], 20)
        finally:
            await rep.close()
        return rep.counters.busy_s / max(r.num_output_tokens for r in reqs)

    assert await per_token(8) > 2 * await per_token(1)


def test_an_arrival_cuts_a_decode_stretch_short_after_the_step_in_progress():
    """A request arriving 2.5 decode steps into another's 99-step stretch waits for the third
    step to end, then prefills alongside the decode: its first token comes within two steps,
    not after the stretch (simulated seconds, exact)."""
    m = TimingModel("d", prefill_s_per_token=1e-4, decode_step_s=1e-2, decode_s_per_seq=0.0,
                    decode_s_per_ctx_token=0.0, num_blocks=64, block_size=16, max_num_seqs=8,
                    max_num_batched_tokens=256)

    async def main():
        rep = SimReplica("a", m)
        rep.start()
        try:
            long = rep.submit("long", prompt(1, 32), 100)
            assert await long.events.get() == 1  # its prefill step's token
            await asyncio.sleep(2.5 * m.decode_step_s)
            late = rep.submit("late", prompt(2, 32), 2)
            assert await late.events.get() == 1
            stretch = await long.events.get()  # the steps decoded before the late one came in
            rep.abort(long)
            return long, late, stretch
        finally:
            await rep.close()

    long, late, stretch = in_sim_time(main)
    assert stretch == 3
    wait = 3 * m.decode_step_s - 2.5 * m.decode_step_s  # the rest of the step in progress
    assert late.first_token_at - late.arrival == pytest.approx(wait + m.step_seconds(32, 1, 0))
    assert late.arrival - long.first_token_at == pytest.approx(2.5 * m.decode_step_s)


def test_adapters_are_an_lru_that_never_evicts_one_in_use():
    async def main() -> None:
        rep = SimReplica("a", FAST, max_loras=2, lora_load_s=0.2)
        rep.start()
        t0 = asyncio.get_running_loop().time()
        assert await rep.load_adapter("x", "/x") and await rep.load_adapter("y", "/y")
        assert asyncio.get_running_loop().time() - t0 == pytest.approx(0.4)  # the load delay
        assert not await rep.load_adapter("x", "/x")  # resident: no load, x is now recent
        # y runs (900 decode steps: ~1 s, past the two loads below), and is the most recent.
        busy = rep.submit("b", prompt(1), 900, lora="y")
        assert await rep.load_adapter("z", "/z")
        assert rep.resident_adapters() == ["y", "z"]  # x (idle, least recent) went
        assert await rep.load_adapter("w", "/w")
        # y is in use and z is idle: z goes, though y is the least recently used.
        assert rep.resident_adapters() == ["y", "w"]
        with pytest.raises(KeyError):
            rep.submit("c", prompt(2), 4, lora="x")
        while await busy.events.get() is not None:
            pass
        assert await rep.load_adapter("v", "/v")
        assert rep.resident_adapters() == ["w", "v"]
        assert (rep.counters.adapter_loads, rep.counters.adapter_evictions) == (5, 3)
        await rep.close()

    in_sim_time(main)


def test_an_adapters_blocks_are_never_shared_with_the_base_model():
    async def main() -> None:
        rep = SimReplica("a", FAST)
        rep.start()
        await rep.load_adapter("x", "/x")
        for lora in (None, "x", None, "x"):
            r = rep.submit("r", prompt(3), 2, lora=lora)
            while await r.events.get() is not None:
                pass
        # The second base request and the second adapter request hit (3 of the 4 blocks: the
        # last prompt token is always computed); the first adapter request misses.
        assert rep.counters.cached_tokens == 2 * 48 and rep.counters.prompt_tokens == 4 * 64
        await rep.close()

    in_sim_time(main)
