"""AsyncEngine over a real LLMEngine (tiny model): streams, aborts, idling, draining, failures."""

from __future__ import annotations

import asyncio
import threading
import time
from typing import Any

import pytest

from kvserve.engine.async_engine import (AsyncEngine, EngineDeadError, EngineDrainingError,
                                         RequestAbortedError)
from kvserve.engine.config import EngineConfig
from kvserve.engine.errors import InvalidRequestError
from kvserve.engine.llm_engine import LLMEngine
from kvserve.engine.sample.sampling_params import SamplingParams


def make_engine(model_dir: Any, cls: type = LLMEngine, **kw: Any) -> LLMEngine:
    return cls.from_config(EngineConfig(model=str(model_dir), max_model_len=256,
                                        kv_cache_memory=2 << 20, **kw))


class StepCounter:
    """An observer that records which thread calls it and how often."""

    def __init__(self) -> None:
        self.steps = 0
        self.threads: set[str] = set()
        self.added: list[str] = []
        self.aborted: list[str] = []
        self.last_stats: Any = None

    def request_added(self, request_id: str, arrival: float) -> None:
        self.added.append(request_id)

    def request_aborted(self, request_id: str) -> None:
        self.aborted.append(request_id)

    def after_step(self, outputs, stats, events, engine) -> None:
        self.steps += 1
        self.last_stats = stats
        self.threads.add(threading.current_thread().name)


def params(n: int = 8, **kw: Any) -> SamplingParams:
    return SamplingParams(max_tokens=n, temperature=0, ignore_eos=True, **kw)


@pytest.fixture
def engine(tiny_model_dir):
    return make_engine(tiny_model_dir)


async def drain(stream) -> list:
    return [out async for out in stream]


async def test_stream_matches_the_synchronous_engine(engine, tiny_model_dir):
    sync = make_engine(tiny_model_dir)
    sync.add_request("s", "The quick brown fox", params(10))
    final = None
    while sync.has_unfinished_requests():
        final = (sync.step() or [final])[-1]
    counter = StepCounter()
    ae = AsyncEngine(engine, [counter])
    ae.start()
    outs = await drain(await ae.add_request("a", "The quick brown fox", params(10)))
    await ae.shutdown(1)
    assert outs[-1].finished and outs[-1].outputs[0].token_ids == final.outputs[0].token_ids
    assert outs[-1].outputs[0].text == final.outputs[0].text
    assert counter.added == ["a"] and counter.threads == {"kvserve-engine"}


async def test_concurrent_requests_all_finish(engine):
    ae = AsyncEngine(engine)
    ae.start()
    streams = [await ae.add_request(f"r{i}", f"prompt {i}", params(6)) for i in range(8)]
    results = await asyncio.gather(*(drain(s) for s in streams))
    await ae.shutdown(1)
    assert all(len(r[-1].outputs[0].token_ids) == 6 for r in results)
    assert ae.num_active == 0


async def test_invalid_request_is_raised_by_add_request(engine):
    ae = AsyncEngine(engine)
    ae.start()
    with pytest.raises(InvalidRequestError):
        await ae.add_request("bad", [], params(2))  # an empty prompt
    ok = await drain(await ae.add_request("ok", "x", params(2)))  # still serving
    await ae.shutdown(1)
    assert ok[-1].finished


async def test_leaving_the_stream_aborts_and_frees_blocks(engine):
    counter = StepCounter()
    ae = AsyncEngine(engine, [counter])
    ae.start()
    stream = await ae.add_request("long", "The quick brown fox", params(200))
    async for out in stream:
        assert not out.finished
        break  # the client went away
    deadline = time.monotonic() + 10
    while counter.aborted != ["long"] and time.monotonic() < deadline:
        await asyncio.sleep(0.01)
    stats = await asyncio.to_thread(lambda: counter.last_stats)
    await ae.shutdown(1)
    assert counter.aborted == ["long"]
    assert stats.num_free_blocks == stats.num_total_blocks and stats.num_running == 0


async def test_cancelled_reader_aborts(engine):
    counter = StepCounter()
    ae = AsyncEngine(engine, [counter])
    ae.start()
    stream = await ae.add_request("c", "The quick brown fox", params(200))
    first = asyncio.Event()

    async def read() -> None:
        async for _ in stream:
            first.set()

    task = asyncio.create_task(read())
    await first.wait()  # seen running (its first token), not a sleep: 199 tokens still to come
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    await ae.shutdown(5)  # nothing left to wait for: the abort came first
    assert counter.aborted == ["c"]


async def parked(ae: AsyncEngine) -> None:
    """Wait until the engine thread sits in its blocking inbox read with nothing to run."""
    import linecache
    import sys
    for _ in range(3000):  # a safety valve only: the thread parks within a few steps
        frame = sys._current_frames().get(ae._thread.ident)
        while frame is not None and frame.f_code.co_name != "_next_commands":
            frame = frame.f_back
        if frame is not None and not ae.engine.has_unfinished_requests():
            line = linecache.getline(frame.f_code.co_filename, frame.f_lineno)
            if "self._inbox.get(timeout=" in line:
                return
        await asyncio.sleep(0.01)
    raise AssertionError("the engine thread never parked in its inbox read")


async def test_idle_thread_blocks_instead_of_spinning(engine):
    """Between two requests the thread is parked in a blocking read (seen in its stack), and
    each request costs the same number of observer calls: an idle loop would add calls."""
    counter = StepCounter()
    ae = AsyncEngine(engine, [counter])
    ae.start()
    await parked(ae)
    marks = [counter.steps]
    for rid in "abc":
        outs = await drain(await ae.add_request(rid, "x", params(3)))
        await parked(ae)
        marks.append(counter.steps)
        assert len(outs[-1].outputs[0].token_ids) == 3
    await ae.shutdown(1)
    costs = [b - a for a, b in zip(marks, marks[1:])]
    # One call per engine step (prefill + 2 decodes) and none while parked.
    assert costs == [3, 3, 3], costs


async def test_idle_tick_wakes_observers(engine):
    counter = StepCounter()
    ae = AsyncEngine(engine, [counter], idle_tick=0.05)
    ae.start()
    deadline = asyncio.get_running_loop().time() + 30
    while counter.steps < 3 and asyncio.get_running_loop().time() < deadline:
        await asyncio.sleep(0.05)
    await ae.shutdown(1)
    assert counter.steps >= 3  # observers woke with no request at all


async def test_shutdown_lets_running_requests_finish(engine):
    ae = AsyncEngine(engine)
    ae.start()
    stream = await ae.add_request("r", "The quick", params(40))
    reader = asyncio.create_task(drain(stream))
    await asyncio.sleep(0)
    aborted = await ae.shutdown(grace_period=60)
    outs = await reader
    assert aborted == 0 and len(outs[-1].outputs[0].token_ids) == 40
    with pytest.raises(EngineDrainingError):
        await ae.add_request("late", "x", params(2))


async def test_shutdown_aborts_what_outlives_the_grace_period(engine):
    ae = AsyncEngine(engine)
    ae.start()
    stream = await ae.add_request("r", "The quick", params(240))
    reader = asyncio.create_task(drain(stream))
    aborted = await ae.shutdown(grace_period=0.05)
    with pytest.raises(RequestAbortedError):
        await reader
    assert aborted == 1 and not ae.is_running


class FailingEngine(LLMEngine):
    """A real engine whose forward pass breaks (a device error, say) a few steps after both of
    the test's requests have arrived: counted from then, not from the first step, so the
    failure never comes before the second reader is in, however fast the engine steps."""

    fail_after = 3
    readers = 2
    added = 0

    def add_request(self, *args, **kwargs):
        out = super().add_request(*args, **kwargs)
        self.added += 1
        return out

    def step(self):
        if self.added >= self.readers:
            self.fail_after -= 1
            if self.fail_after < 0:
                raise RuntimeError("device lost")
        return super().step()


async def test_engine_failure_reaches_every_reader_and_new_requests(tiny_model_dir):
    ae = AsyncEngine(make_engine(tiny_model_dir, cls=FailingEngine))
    ae.start()
    streams = [await ae.add_request(f"r{i}", "The quick", params(50)) for i in range(2)]
    for s in streams:
        with pytest.raises(EngineDeadError, match="device lost"):
            await drain(s)
    with pytest.raises(EngineDeadError):
        await ae.add_request("after", "x", params(2))
    assert isinstance(ae.error, RuntimeError)
    await ae.shutdown(0)


def seeded(n: int) -> SamplingParams:
    return SamplingParams(max_tokens=n, temperature=1.0, seed=1, ignore_eos=True)


def test_a_request_that_fails_in_a_step_fails_alone(tiny_model_dir):
    engine = make_engine(tiny_model_dir)
    bad = seeded(6)
    engine.add_request("good", "The quick", params(6))
    engine.add_request("bad", "The quick", bad)
    bad.seed = 2**70  # changed after it was accepted: the step cannot seed its generator
    finals: dict[str, Any] = {}
    errors: dict[str, BaseException] = {}
    while engine.has_unfinished_requests():
        finals.update((out.request_id, out) for out in engine.step())
        errors.update(engine.take_request_errors())
    assert list(errors) == ["bad"] and "Overflow" in str(errors["bad"])
    assert len(finals["good"].outputs[0].token_ids) == 6
    assert finals["bad"].outputs[0].finish_reason == "abort"
    stats = engine.get_stats()
    assert stats.num_free_blocks == stats.num_total_blocks  # the failed request freed its blocks


async def test_a_request_that_fails_alone_does_not_stop_the_loop(tiny_model_dir):
    ae = AsyncEngine(make_engine(tiny_model_dir, max_num_seqs=1))
    ae.start()
    running = await ae.add_request("running", "The quick", params(200))
    bad = seeded(4)
    waiting = await ae.add_request("bad", "The quick", bad)
    bad.seed = 2**70  # it waits behind `running` (one seq at a time): the step will fail it
    with pytest.raises(ValueError, match="Overflow"):
        await drain(waiting)
    assert len((await drain(running))[-1].outputs[0].token_ids) == 200
    changed = seeded(4)
    changed.seed = -(2**64)  # changed before it was added: refused at once, by name
    with pytest.raises(InvalidRequestError) as info:
        await ae.add_request("refused", "The quick", changed)
    assert info.value.param == "seed"
    after = await drain(await ae.add_request("after", "The quick", seeded(3)))
    assert len(after[-1].outputs[0].token_ids) == 3
    assert ae.error is None and ae.is_running
    await ae.shutdown(1)
