"""Shutdown steps end even when a library swallows the cancellation (issue 41: a router sat 13
minutes in "Waiting for application shutdown" on its shared-load loop)."""

from __future__ import annotations

import asyncio

from redis.exceptions import ConnectionError as RedisConnectionError

from kvserve.service.bounded import stop_task, within
from kvserve.service.router.shared_load import SharedInflight


async def _stubborn(release: asyncio.Event) -> None:
    """A task that takes every cancellation for a network error and carries on (until the test
    releases it, so that its event loop can close)."""
    while not release.is_set():
        try:
            await asyncio.sleep(0.01)
        except asyncio.CancelledError:
            pass


def test_stop_task_returns_for_a_task_that_ignores_cancellation() -> None:
    async def main() -> tuple[bool, bool]:
        release = asyncio.Event()
        task = asyncio.ensure_future(_stubborn(release))
        await asyncio.sleep(0.02)  # it runs (a task cancelled before its start just ends)
        ended = await stop_task(task, 0.05)
        running = not task.done()
        release.set()
        await asyncio.wait({task})
        return ended, running

    assert asyncio.run(main()) == (False, True)


def test_within_reports_work_that_ends() -> None:
    assert asyncio.run(within(asyncio.sleep(0), 1.0, "nothing")) is True


class _SwallowingPipeline:
    """What a Redis client does at worst: a cancellation arrives as a ConnectionError."""

    def __getattr__(self, name: str):
        return lambda *a, **k: self

    async def execute(self) -> None:
        try:
            await asyncio.sleep(3600)
        except asyncio.CancelledError:
            raise RedisConnectionError("connection closed") from None


class _SwallowingClient:
    def register_script(self, _: str):
        async def script(**_: object) -> list:
            return []
        return script

    def pipeline(self, transaction: bool = True) -> _SwallowingPipeline:
        return _SwallowingPipeline()


def test_the_shared_load_loop_stops_when_redis_turns_its_cancel_into_an_error() -> None:
    async def main() -> bool:
        shared = SharedInflight(_SwallowingClient(), "svc", {"r": 1}, interval=0.01)
        shared.start()
        await asyncio.sleep(0.05)  # the loop is inside a write that never answers
        task = shared._task
        await shared.close(timeout=0.5)
        return task.done()

    assert asyncio.run(main()) is True
