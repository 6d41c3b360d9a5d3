"""What one simulated replica holds per request and publishes: SimRequest (its engine Sequence,
progress, event queue), the load the heartbeat reads, and the replica's counters."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field

from kvserve.engine.core.sequence import Sequence


def sim_now() -> float:
    """The event loop's clock (what `asyncio.sleep` and timeouts run on; time.monotonic by
    default), so a test's fast-forwarded loop times the simulation in simulated seconds."""
    try:
        return asyncio.get_running_loop().time()
    except RuntimeError:  # no loop running (a submit from synchronous code)
        return time.monotonic()


class CapacityError(ValueError):
    """A prompt that cannot fit in the replica's KV pool even alone."""


@dataclass(eq=False)
class SimRequest:
    """One request inside a replica: its sequence, progress, and what its HTTP handler reads."""

    seq: Sequence
    max_tokens: int
    arrival: float = field(default_factory=sim_now)
    cached_tokens: int = -1  # prompt tokens found in the prefix cache at (first) admission
    first_token_at: float | None = None
    finished: bool = False
    error: str | None = None
    # Tokens produced per event (first token, then decode stretches); None ends the stream.
    events: asyncio.Queue = field(default_factory=asyncio.Queue)
    lora: str | None = None  # the adapter it runs with

    @property
    def num_prompt_tokens(self) -> int:
        return self.seq.num_prompt_tokens

    @property
    def num_output_tokens(self) -> int:
        return len(self.seq.output_token_ids)


@dataclass
class SimLoad:
    """What the heartbeat publishes (the attribute names `on_step` reads from EngineStats)."""

    num_running: int
    num_waiting: int
    kv_cache_usage: float


@dataclass
class ReplicaCounters:
    requests: int = 0
    finished: int = 0
    prompt_tokens: int = 0  # looked up at first admission
    cached_tokens: int = 0  # of those, found in this replica's cache (the true hit count)
    preemptions: int = 0
    swaps: int = 0  # of the preemptions, those that swapped the sequence out (not recompute)
    busy_s: float = 0.0  # simulated seconds spent in steps
    adapter_requests: int = 0  # requests naming a resident adapter
    adapter_loads: int = 0  # adapters loaded (a load of a resident one is not counted)
    adapter_evictions: int = 0
