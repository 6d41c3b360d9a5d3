"""TokenizerPool runs tokenizer work off the event loop; run_with_time_limit stops runaway
pure-Python work (a request's chat template) in its own thread."""

from __future__ import annotations

import asyncio
import threading

import pytest
from conftest import build_tiny_tokenizer

from kvserve.service.server.time_limit import TimeLimitExceeded, run_with_time_limit
from kvserve.service.server.tokenizer_pool import TokenizerPool


async def test_the_loop_runs_while_the_pool_works():
    # The job waits for a callback that only the event loop can run: on the loop it would never
    # return (the wait times out and the job reports it).
    pool = TokenizerPool(build_tiny_tokenizer())
    loop_ran = threading.Event()

    def job(tokenizer, text):
        asyncio.run_coroutine_threadsafe(_set(loop_ran), loop)
        return loop_ran.wait(timeout=30), tokenizer(text)["input_ids"]

    loop = asyncio.get_running_loop()
    try:
        ran, ids = await pool.run(job, "Paged attention")
    finally:
        pool.shutdown()
    assert ran and ids


async def _set(event: threading.Event) -> None:
    event.set()


async def test_each_worker_thread_has_its_own_tokenizer():
    tokenizer = build_tiny_tokenizer()
    pool = TokenizerPool(tokenizer, threads=2)
    barrier = threading.Barrier(2)

    def which(tok):
        barrier.wait(timeout=30)  # both threads busy at once
        return id(tok)

    try:
        ids = await asyncio.gather(pool.run(which), pool.run(which))
    finally:
        pool.shutdown()
    assert len(set(ids)) == 2 and id(tokenizer) not in ids


def test_runaway_python_is_stopped_at_its_time_limit():
    def spin():
        while True:
            pass

    with pytest.raises(TimeLimitExceeded):
        run_with_time_limit(0.2, spin)


def test_work_within_the_limit_returns_and_the_trace_is_removed():
    import sys

    before = sys.gettrace()
    assert run_with_time_limit(5, sum, [1, 2, 3]) == 6
    assert sys.gettrace() is before
