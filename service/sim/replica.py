"""SimReplica: one simulated replica — the engine's real KV accounting (KVCacheManager over
BlockPool: prefix lookup, LRU eviction, block hashes) under a timing model instead of a model.

Continuous batching as the engine's scheduler does it, in simulated time (`asyncio.sleep`):
requests are admitted FCFS while `max_num_seqs` and the block pool allow; a step computes up to
`max_num_batched_tokens` prompt tokens (chunked prefill) plus one token for every decoding
sequence; when no block is left for a decode the newest sequence is preempted by recompute.
A run of decode-only steps is slept as one stretch, cut short by an arrival (the arrival then
waits for the step in progress to end), so a replica wakes per event, not per token: 256 of them
fit in one event loop. After every stretch the pool's KV events and the load go to Redis through
the real `PrefixIndexPublisher`, so the router sees exactly what this replica caches.

LoRA adapters as vLLM keeps them: a resident set of up to `max_loras`, loaded by name after a
`lora_load_s` delay, the least recently used idle adapter evicted to make room (never one with
requests in flight: the set may exceed `max_loras` until one is idle); a request for an adapter
keys its blocks by the adapter (its KV is never shared with the base model's or another's).
"""

from __future__ import annotations

import asyncio
import itertools
import math
import time
from collections import Counter, OrderedDict
from dataclasses import dataclass, field
from typing import Any

from kvserve.engine.core.kv_cache_manager import KVCacheManager
from kvserve.engine.core.sequence import Sequence
from kvserve.engine.sample.sampling_params import SamplingParams
from kvserve.service.prefix_index.extra_keys import block_extra_keys
from kvserve.service.sim.timing import TimingModel

_OUTPUT_TOKEN = 29  # the token every simulated output is made of (its text is " x")
PREEMPTION_MODES = ("recompute", "swap", "auto")  # the engine's (EngineConfig.preemption_mode)
_seq_ids = itertools.count()


def _now() -> float:
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
    arrival: float = field(default_factory=_now)
    target: int = 0  # tokens to prefill before the next output (prompt, + outputs if resumed)
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


class AdapterNotFoundError(KeyError):
    """A request for an adapter this replica does not hold (vLLM's 404)."""


class SimReplica:
    """One simulated replica; `publisher` (a PrefixIndexPublisher or None) is started by the
    fleet and fed here after every stretch of steps."""

    def __init__(self, replica_id: str, timing: TimingModel, publisher: Any = None, *,
                 max_loras: int = 8, lora_load_s: float = 0.05,
                 preemption_mode: str = "auto") -> None:
        if max_loras < 1:
            raise ValueError(f"max_loras must be at least 1, got {max_loras}")
        if preemption_mode not in PREEMPTION_MODES:
            raise ValueError(f"preemption_mode {preemption_mode!r}: expected one of "
                             f"{PREEMPTION_MODES}")
        self.replica_id, self.timing, self.publisher = replica_id, timing, publisher
        self.max_loras, self.lora_load_s = max_loras, lora_load_s
        self.preemption_mode = preemption_mode
        self.adapters: OrderedDict[str, str] = OrderedDict()  # name -> path, LRU first
        self._adapter_use: Counter[str] = Counter()  # requests in flight per adapter
        self.kv = self._new_kv()
        self.waiting: list[SimRequest] = []
        self.running: list[SimRequest] = []
        self.swapped: list[SimRequest] = []  # preempted to the CPU pool, oldest swap last
        self._preempted = False  # in the step just simulated: no swap-in or admission after it
        self._swap_blocks = 0  # blocks copied (out or in) since the last step, costed in it
        self.counters = ReplicaCounters()
        self._wake = asyncio.Event()
        self._task: asyncio.Task | None = None

    def _new_kv(self) -> KVCacheManager:
        return KVCacheManager(self.timing.num_blocks, self.timing.block_size,
                              num_cpu_blocks=self.timing.num_cpu_blocks)

    # ---- lifecycle ----------------------------------------------------------------------------
    def start(self) -> None:
        self._task = asyncio.create_task(self._loop(), name=f"sim-{self.replica_id}")
        self._publish()

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
            self._task = None
        for r in self.waiting + self.running + self.swapped:
            self._finish(r, error="replica stopped")

    def reset(self) -> None:
        """Forget every cached block, adapter and counter (between benchmark runs); needs an idle
        replica. The publisher replaces the replica's sets with the empty snapshot."""
        if self.waiting or self.running or self.swapped:
            raise RuntimeError(f"replica {self.replica_id} is busy; reset it when idle")
        self.kv = self._new_kv()
        self.counters = ReplicaCounters()
        self.adapters.clear()
        if self.publisher is not None:
            self.publisher.on_step([], self.load(), snapshot=[], host_snapshot=[])

    # ---- what the HTTP side and the benchmark's oracle read -----------------------------------
    def submit(self, request_id: str, prompt: list[int], max_tokens: int,
               cache_salt: str | None = None, lora: str | None = None) -> SimRequest:
        """Queue a request; CapacityError when it could never fit the pool,
        AdapterNotFoundError when `lora` is not resident."""
        if lora is not None and lora not in self.adapters:
            raise AdapterNotFoundError(lora)
        blocks = -(-(len(prompt) + max_tokens) // self.timing.block_size)
        if blocks > self.timing.num_blocks:
            raise CapacityError(f"prompt + max_tokens need {blocks} KV blocks; this replica has "
                                f"{self.timing.num_blocks}")
        params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
        # The engine keys an adapter's blocks by its name: the same extra keys here.
        seq = Sequence(next(_seq_ids), request_id, 0, list(prompt), params,
                       cache_salt=block_extra_keys(cache_salt, lora))  # type: ignore[arg-type]
        req = SimRequest(seq, max_tokens, lora=lora)
        if lora is not None:
            self.adapters.move_to_end(lora)
            self._adapter_use[lora] += 1
            self.counters.adapter_requests += 1
        self.waiting.append(req)
        self.counters.requests += 1
        self._wake.set()
        return req

    def abort(self, req: SimRequest) -> None:
        if req.finished:
            return
        if req in self.waiting:
            self.waiting.remove(req)
        if req in self.running:
            self.running.remove(req)
            self.kv.free(req.seq)
        if req in self.swapped:
            self.swapped.remove(req)
            self.kv.free(req.seq)
        self._finish(req, error="aborted")

    async def load_adapter(self, name: str, path: str) -> bool:
        """Load `name` after the load delay; False when it was resident already."""
        if name in self.adapters:
            self.adapters.move_to_end(name)
            return False
        await asyncio.sleep(self.lora_load_s)
        if name in self.adapters:  # a concurrent load of the same name finished first
            return False
        self.adapters[name] = path
        self.counters.adapter_loads += 1
        self._evict_adapters()
        self._publish()
        return True

    def unload_adapter(self, name: str) -> None:
        """AdapterNotFoundError when it is not resident."""
        if name not in self.adapters:
            raise AdapterNotFoundError(name)
        del self.adapters[name]
        self._publish()

    def _evict_adapters(self) -> None:
        """Least recently used idle adapters out until `max_loras` remain (or none is idle)."""
        for name in list(self.adapters):
            if len(self.adapters) <= self.max_loras:
                return
            if not self._adapter_use[name]:
                del self.adapters[name]
                self.counters.adapter_evictions += 1

    def resident_adapters(self) -> list[str]:
        """What the heartbeat publishes."""
        return list(self.adapters)

    def load(self) -> SimLoad:
        return SimLoad(len(self.running), len(self.waiting) + len(self.swapped), self.kv.usage())

    def cached_prefix_blocks(self, hashes: list[bytes]) -> int:
        """Leading blocks of a hash chain (engine.block_hash's bytes) this replica's pool holds
        right now: the truth the router's index approximates."""
        cached = self.kv.pool.cached
        n = 0
        for h in hashes:
            if h not in cached:
                break
            n += 1
        return n

    def queued_prefill_tokens(self) -> int:
        """Prompt tokens admitted or waiting but not computed yet (the oracle's queue estimate)."""
        left = sum(max(r.target - r.seq.num_computed_tokens, 0) for r in self.running)
        return left + sum(r.seq.num_tokens for r in self.waiting)

    # ---- the step loop ------------------------------------------------------------------------
    async def _loop(self) -> None:
        while True:
            if not self.waiting and not self.running and not self.swapped:
                self._wake.clear()
                await self._wake.wait()
            if not self._preempted:  # as the engine: a step that preempted admits no one
                self._swap_in()
                if not self.swapped:
                    self._admit()
            self._preempted = False
            if not self.running:  # the head of the queue waits for blocks no one will free
                self._wake.clear()
                await self._wake.wait()
                continue
            if any(r.seq.num_computed_tokens < r.target for r in self.running):
                await self._prefill_step()
            else:
                await self._decode_stretch()
            self._publish()

    def _admit(self) -> None:
        """FCFS admission as the engine's scheduler does it: within the step's token budget
        (after the running sequences' chunks and decodes), and a request whose next uncached
        block the step computes already sits this step out, to hit the cache on the next one."""
        budget, pending = self._running_budget()
        i = 0
        while (i < len(self.waiting) and budget > 0
               and len(self.running) < self.timing.max_num_seqs):
            req = self.waiting[i]
            seq = req.seq
            hits = self.kv.lookup_prefix(seq)
            nxt = self.kv.full_block_hashes(seq, len(hits), len(hits) + 1)
            if nxt and nxt[0] in pending:
                i += 1  # deferred: keeps its place in the queue
                continue
            if not self.kv.allocate_slots(seq, seq.num_tokens - len(hits) * self.kv.block_size,
                                          hits):
                if not self.running:  # alone and still no room: it can never run
                    self.waiting.pop(i)
                    self._finish(req, error="does not fit the KV cache")
                    continue
                return
            self.waiting.pop(i)
            seq.num_computed_tokens = len(hits) * self.kv.block_size
            req.target = seq.num_tokens
            if req.cached_tokens < 0:  # first admission: the request's hit figures
                req.cached_tokens = seq.num_computed_tokens
                self.kv.record_lookup(seq.num_prompt_tokens, req.cached_tokens)
                self.counters.prompt_tokens += seq.num_prompt_tokens
                self.counters.cached_tokens += req.cached_tokens
            n = min(req.target - seq.num_computed_tokens, budget)
            budget -= n
            pending.update(self.kv.full_block_hashes(
                seq, len(hits), (seq.num_computed_tokens + n) // self.kv.block_size))
            self.running.append(req)

    def _swap_in(self) -> None:
        """Swapped sequences back to the device, oldest preemption first, as the engine's
        scheduler does: while the seq limit, the token budget and the free blocks (its own and
        its next token's) allow; the blocks' copy is costed in the next step."""
        budget, _ = self._running_budget()
        while self.swapped and budget > 0 and len(self.running) < self.timing.max_num_seqs:
            req = self.swapped[0]
            if not self.kv.can_swap_in(req.seq, 1):
                return
            self._swap_blocks += len(self.kv.swap_in(req.seq))
            self.swapped.pop(0)
            self.running.append(req)
            budget -= 1

    def _running_budget(self) -> tuple[int, set[bytes]]:
        """The step's token budget left after the running sequences (a prefill chunk or one
        decode token each), and the hashes of the full blocks their chunks compute."""
        budget, pending, bs = self.timing.max_num_batched_tokens, set(), self.kv.block_size
        for r in self.running:
            done = r.seq.num_computed_tokens
            n = min(max(r.target - done, 1), budget)
            budget -= n
            if n > 1:
                pending.update(self.kv.full_block_hashes(r.seq, done // bs, (done + n) // bs))
        return budget, pending

    async def _prefill_step(self) -> None:
        budget = self.timing.max_num_batched_tokens
        chunks: list[tuple[SimRequest, int]] = []
        decoding: list[SimRequest] = []
        for r in self.running:
            left = r.target - r.seq.num_computed_tokens
            if left <= 0:
                decoding.append(r)
            elif budget > 0:
                n = min(left, budget)
                budget -= n
                chunks.append((r, n))
        context = sum(r.seq.num_tokens for r in decoding)
        dt = self.timing.step_seconds(sum(n for _, n in chunks), len(decoding), context) + \
            self._take_swap_seconds()
        await asyncio.sleep(dt)
        self.counters.busy_s += dt
        now = _now()
        for r, n in chunks:
            r.seq.num_computed_tokens += n
            self.kv.register_computed(r.seq)
            if r.seq.num_computed_tokens >= r.target:
                self._emit(r, 1, now)
        self._advance(decoding, 1, now)

    async def _decode_stretch(self) -> None:
        """Decode-only steps until the first sequence finishes, cut short by an arrival."""
        seqs = list(self.running)
        steps = max(self._steps_that_fit(seqs, min(r.max_tokens - r.num_output_tokens
                                                   for r in seqs)), 1)
        dt = self.timing.step_seconds(0, len(seqs), sum(r.seq.num_tokens for r in seqs))
        swap_s = self._take_swap_seconds()
        if swap_s:  # the copies of a swap-in delay the first step of the stretch
            await asyncio.sleep(swap_s)
            self.counters.busy_s += swap_s
        self._wake.clear()
        t0 = _now()
        try:  # not asyncio.wait_for: on 3.11 it can swallow a cancel
            async with asyncio.timeout(steps * dt):
                await self._wake.wait()
        except TimeoutError:
            pass
        else:  # an arrival: finish the step in progress, then let it in
            done = min(max(math.ceil((_now() - t0) / dt), 1), steps) if dt else steps
            rest = done * dt - (_now() - t0)
            if rest > 0:
                await asyncio.sleep(rest)
            steps = done
        self.counters.busy_s += steps * dt
        self._advance(seqs, steps, _now())

    def _steps_that_fit(self, seqs: list[SimRequest], steps: int) -> int:
        """The most decode steps (up to `steps`) whose new blocks the free pool holds: the
        stretch ends before the step where the engine would preempt, which runs alone."""
        bs, free = self.kv.block_size, self.kv.num_free_blocks

        def fits(k: int) -> bool:
            return sum(max(-(-(r.seq.num_computed_tokens + k) // bs)
                           - self.kv.num_blocks_of(r.seq), 0) for r in seqs) <= free

        lo, hi = 0, steps  # fits(0) holds: the largest k that fits, by bisection
        while lo < hi:
            mid = (lo + hi + 1) // 2
            lo, hi = (mid, hi) if fits(mid) else (lo, mid - 1)
        return lo

    def _advance(self, seqs: list[SimRequest], steps: int, now: float) -> None:
        """`steps` decode steps for each of `seqs` (a sequence preempted meanwhile is skipped)."""
        for r in seqs:
            if r.finished or r not in self.running:
                continue
            while not self.kv.allocate_slots(r.seq, steps):
                victim = self.running[-1]
                self._preempt(victim)
                if victim is r:
                    break
            else:
                r.seq.num_computed_tokens += steps
                self.kv.register_computed(r.seq)
                self._emit(r, steps, now)

    def _preempt(self, r: SimRequest) -> None:
        """As the engine's scheduler: swap the blocks out to the CPU pool when the mode and the
        pool allow it ("auto": when the timing model says copying beats recomputing), else
        free them to recompute, back at the head of the queue."""
        self.running.remove(r)
        self._preempted = True
        self.counters.preemptions += 1
        if self._should_swap(r):
            self._swap_blocks += len(self.kv.swap_out(r.seq))
            self.swapped.insert(0, r)
            self.counters.swaps += 1
            return
        self.kv.free(r.seq)
        r.seq.num_computed_tokens = 0
        self.waiting.insert(0, r)

    def _should_swap(self, r: SimRequest) -> bool:
        if self.preemption_mode == "recompute" or not self.kv.can_swap_out(r.seq):
            return False
        return self.preemption_mode == "swap" or self.timing.prefer_swap(
            self.kv.num_blocks_of(r.seq), r.seq.num_computed_tokens)

    def _take_swap_seconds(self) -> float:
        """The cost of the blocks swapped since the last step (charged to this one)."""
        n, self._swap_blocks = self._swap_blocks, 0
        return n * self.timing.swap_s_per_block

    def _emit(self, r: SimRequest, n: int, now: float) -> None:
        r.seq.output_token_ids.extend([_OUTPUT_TOKEN] * n)
        if r.first_token_at is None:
            r.first_token_at = now
        r.events.put_nowait(n)
        if r.num_output_tokens >= r.max_tokens:
            self.running.remove(r)
            self.kv.free(r.seq)
            self.counters.finished += 1
            self._finish(r)

    def _finish(self, r: SimRequest, error: str | None = None) -> None:
        if r.finished:
            return
        r.finished, r.error = True, error
        if r.lora is not None:
            self._adapter_use[r.lora] -= 1
        r.events.put_nowait(None)

    def _publish(self) -> None:
        pub = self.publisher
        if pub is None:
            return
        events = self.kv.pool.drain_events()
        if pub.wants_snapshot():
            pub.on_step(events, self.load(), snapshot=self.kv.pool.cached_hashes(),
                        host_snapshot=[])
        else:
            pub.on_step(events, self.load())
