"""Tokenizing, chat templates and detokenizing off the event loop, on a few dedicated threads.

A 100k-token prompt takes seconds to tokenize; on the event loop that would stall every other
request and `/health` with it. The pool's threads release the event loop (the Rust tokenizer also
releases the GIL while it encodes). Each thread has its own copy of the tokenizer, because a
Hugging Face fast tokenizer is not safe to call from two threads at once ("Already borrowed").
The pool is bounded: a fixed number of threads, and the jobs queued for them are bounded by
admission (`--max-waiting`), since every job belongs to an admitted request."""

from __future__ import annotations

import asyncio
import copy
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

T = TypeVar("T")

DEFAULT_THREADS = 2


class TokenizerPool:
    """Runs `fn(tokenizer, *args)` on one of `threads` worker threads, each with its own copy."""

    def __init__(self, tokenizer: Any, threads: int = DEFAULT_THREADS) -> None:
        self.tokenizer = tokenizer  # the original, copied once per worker thread
        self._local = threading.local()
        self._executor = ThreadPoolExecutor(max_workers=threads,
                                            thread_name_prefix="kvserve-tokenize")

    async def run(self, fn: Callable[..., T], *args: Any) -> T:
        """`fn(tokenizer, *args)` on a worker thread; the caller's loop stays free meanwhile."""
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._executor, self._call, fn, args)

    def _call(self, fn: Callable[..., T], args: tuple[Any, ...]) -> T:
        tokenizer = getattr(self._local, "tokenizer", None)
        if tokenizer is None:
            tokenizer = self._local.tokenizer = copy.deepcopy(self.tokenizer)
        return fn(tokenizer, *args)

    def shutdown(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)
