"""vLLM's AsyncLLM.pause_generation / resume_generation / is_paused, in its three modes, with the
engine stepped in a thread and with the engine core in its own process. Progress is read from
the engine's own counters after several round trips through its loop, not from the clock."""

from __future__ import annotations

import asyncio

import pytest

from kvserve.engine.arg_utils import AsyncEngineArgs
from kvserve.engine.engine_core import MULTIPROCESSING_ENV
from kvserve.sampling_params import SamplingParams
from kvserve.v1.engine.async_llm import AsyncLLM

PROMPT = "The quick brown fox"


def greedy(n: int) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)


@pytest.fixture(scope="module", params=["thread", "process"])
def engine(request, tiny_model_dir):
    mp = pytest.MonkeyPatch()
    mp.setenv(MULTIPROCESSING_ENV, "1" if request.param == "process" else "0")
    engine = AsyncLLM.from_engine_args(AsyncEngineArgs(
        model=str(tiny_model_dir), dtype="float32", device="cpu", kv_cache_memory=1 << 22))
    mp.undo()
    yield engine
    engine.shutdown()


async def collect(engine: AsyncLLM, rid: str, n: int, outs: list) -> list:
    async for out in engine.generate(PROMPT, greedy(n), rid):
        outs.append(out)
    return outs


async def until(outs: list, count: int) -> None:
    while len(outs) < count:
        await asyncio.sleep(0.005)


async def core(engine: AsyncLLM, method: str):
    return await engine.engine._call(method)


async def spin_the_loop(engine: AsyncLLM) -> list[bool]:
    """Five calls through the engine's loop; each would have stepped a runnable engine."""
    return [await engine.reset_prefix_cache() for _ in range(5)]


async def test_keep_freezes_the_running_request_and_holds_new_ones(engine):
    reference = (await collect(engine, "ref", 12, []))[-1].outputs[0].token_ids
    outs: list = []
    task = asyncio.create_task(collect(engine, "kept", 12, outs))
    await until(outs, 2)
    await engine.pause_generation(mode="keep")
    shown = len(outs)  # what the reader holds once the pause returns: nothing comes after it
    assert await engine.is_paused()
    before = (await core(engine, "get_stats")).generation_tokens
    late: list = []
    late_task = asyncio.create_task(collect(engine, "late", 4, late))
    assert await spin_the_loop(engine) == [False] * 5  # the frozen request still holds blocks
    assert (await core(engine, "get_stats")).generation_tokens == before
    assert await core(engine, "get_num_unfinished_requests") == 1 and late == []
    assert len(outs) == shown  # the step before the pause reached the reader before it returned
    await engine.resume_generation()
    assert not await engine.is_paused()
    await asyncio.gather(task, late_task)
    assert outs[-1].finished and outs[-1].outputs[0].token_ids == reference
    assert late[-1].finished and len(late[-1].outputs[0].token_ids) == 4


async def test_abort_ends_what_runs_and_clears_the_cache(engine):
    outs: list = []
    task = asyncio.create_task(collect(engine, "doomed", 40, outs))
    await until(outs, 1)
    await engine.pause_generation(mode="abort")
    await task
    assert outs[-1].finished and outs[-1].outputs[0].finish_reason == "abort"
    assert len(outs[-1].outputs[0].token_ids) < 40
    assert await core(engine, "get_num_unfinished_requests") == 0
    assert await core(engine, "cached_block_hashes") == []  # clear_cache=True, the default
    await engine.resume_generation()
    assert (await collect(engine, "after", 3, []))[-1].finished


async def test_wait_returns_once_in_flight_requests_finish(engine):
    outs: list = []
    task = asyncio.create_task(collect(engine, "finishing", 8, outs))
    await until(outs, 1)
    await engine.pause_generation(mode="wait", clear_cache=False)
    assert outs[-1].finished and len(outs[-1].outputs[0].token_ids) == 8
    assert await core(engine, "cached_block_hashes") != []  # clear_cache=False keeps them
    held: list = []
    held_task = asyncio.create_task(collect(engine, "held", 2, held))
    await spin_the_loop(engine)
    assert held == [] and await core(engine, "get_num_unfinished_requests") == 0
    await engine.resume_generation()
    await asyncio.gather(task, held_task)
    assert held[-1].finished


async def test_an_unknown_mode_is_refused_by_name(engine):
    with pytest.raises(ValueError, match="pause mode"):
        await engine.pause_generation(mode="freeze")
    assert not await engine.is_paused()
