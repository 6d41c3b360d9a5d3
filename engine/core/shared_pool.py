"""SharedBlockPool: one BlockPool of pages serving several models in one process (vLLM's
"several models, one pool"). Each model keeps its own KVCacheManager and scheduler over the
same pages; free pages go to whichever model asks, eviction is LRU across models, prefix-cache
keys carry the model (KVCacheManager's `model_key`), and the engines step in turns.

A page holds one block of the largest model's layout: block ids stay page ids (no multi-page
blocks, no per-model indirection), at the cost of the gap between a smaller model's block and
the page (the model runner's view leaves it unused; see docs/guides/multi-model.md)."""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass, field

from kvserve.engine.core.block_pool import BlockPool
from kvserve.engine.errors import ConfigError


class TurnLock:
    """A re-entrant lock handed out in arrival order, so engine threads that step over one pool
    take turns (threading.Lock lets the releasing thread win again and starve the others)."""

    def __init__(self) -> None:
        self._cond = threading.Condition(threading.Lock())
        self._next = self._serving = 0
        self._owner: int | None = None
        self._depth = 0

    def __enter__(self) -> "TurnLock":
        me = threading.get_ident()
        with self._cond:
            if self._owner == me:
                self._depth += 1
                return self
            ticket, self._next = self._next, self._next + 1
            self._cond.wait_for(lambda: self._serving == ticket)
            self._owner, self._depth = me, 1
        return self

    def __exit__(self, *exc: object) -> None:
        with self._cond:
            self._depth -= 1
            if self._depth == 0:
                self._owner = None
                self._serving += 1
                self._cond.notify_all()


@dataclass
class _Member:
    bytes_per_block: int
    waiting: bool = False  # has requests waiting for admission (set by its scheduler)


@dataclass
class SharedBlockPool:
    """The pages (a BlockPool), their byte size, and the models on them.

    Fair by default: a model holding more than an equal share of the pages admits no new
    request while another model has requests waiting (its running ones keep going), so a
    burst on one model cannot keep the other out once its own requests finish."""

    num_pages: int
    page_bytes: int
    enable_caching: bool = True
    fair: bool = True
    pool: BlockPool = field(init=False)
    lock: TurnLock = field(init=False, default_factory=TurnLock)
    members: dict[str, _Member] = field(init=False, default_factory=dict)

    def __post_init__(self) -> None:
        self.pool = BlockPool(self.num_pages, self.enable_caching)

    def join(self, model: str, bytes_per_block: int) -> BlockPool:
        """Register a model whose block takes `bytes_per_block`; the pool it allocates from."""
        if model in self.members:
            raise ConfigError(f"model {model!r} is already on this KV pool; pick another name")
        if bytes_per_block > self.page_bytes:
            raise ConfigError(
                f"model {model!r} needs {bytes_per_block} bytes per block, the shared pool's "
                f"pages hold {self.page_bytes}: start the server with the largest model among "
                "its models (or a smaller block size)")
        with self.lock:  # a model loaded at runtime: the other engines' steps read `members`
            self.members[model] = _Member(bytes_per_block)
        return self.pool

    def leave(self, model: str) -> int:
        """Drop a model (its sequences must be gone): its cached pages are forgotten so a
        model later loaded under the same name never reads them. Returns how many."""
        with self.lock:
            self.members.pop(model, None)
            return self.pool.forget_owner(model)

    def report(self, model: str, waiting: bool) -> None:
        self.members[model].waiting = waiting

    def may_admit(self, model: str, held: Callable[[], int]) -> bool:
        """Whether `model`, holding `held()` pages (counted only when another model waits),
        may take pages for a new request now (see the class docstring)."""
        if not self.fair or len(self.members) < 2:
            return True
        others_wait = any(m.waiting for name, m in self.members.items() if name != model)
        return not others_wait or held() * len(self.members) < self.num_pages

    def waste(self, model: str) -> float:
        """The fraction of each page `model`'s blocks leave unused."""
        return 1.0 - self.members[model].bytes_per_block / self.page_bytes
