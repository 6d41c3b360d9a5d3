"""SimReplica: one simulated replica — the engine's own Scheduler over its own KVCacheManager
(admission, chunked prefill, preemption by recompute or swap, prefix lookup, LRU eviction, block
hashes), with the timing model (timing.py) in place of the forward pass.

Each step is the scheduler's batch, slept in simulated time (`asyncio.sleep`) for what the
timing model says it costs, then applied as the engine applies a step's output (computed
counts move on, full blocks are cached, a finished prefill or a decode emits a token). A run of
decode-only steps is slept as one stretch, cut short by an arrival (the arrival then waits for
the step in progress to end), so a replica wakes per event, not per token: 256 of them fit in
one event loop. The stretch's later steps are the scheduler's first step repeated (the same
batch, nothing to admit, every block it needs free), so they are applied without asking it
again. After every stretch the pool's KV events and the load go to Redis through the real
`PrefixIndexPublisher`, so the router sees exactly what this replica caches.

LoRA adapters: adapters.py; a request for an adapter keys its blocks by the adapter (its KV is
never shared with the base model's or another's).
"""

from __future__ import annotations

import asyncio
import itertools
import math
from typing import Any

from kvserve.engine.core.kv_cache_manager import KVCacheManager
from kvserve.engine.core.scheduler import Scheduler, SchedulerConfig, SchedulerOutput
from kvserve.engine.core.sequence import Sequence
from kvserve.engine.sample.sampling_params import SamplingParams
from kvserve.service.prefix_index.extra_keys import block_extra_keys
from kvserve.service.sim.adapters import AdapterNotFoundError, ResidentAdapters
from kvserve.service.sim.request import (CapacityError, ReplicaCounters, SimLoad, SimRequest,
                                         sim_now)
from kvserve.service.sim.timing import TimingModel

__all__ = ["AdapterNotFoundError", "CapacityError", "PREEMPTION_MODES", "SimLoad", "SimReplica",
           "SimRequest"]

_OUTPUT_TOKEN = 29  # the token every simulated output is made of (its text is " x")
PREEMPTION_MODES = ("recompute", "swap", "auto")  # the engine's (EngineConfig.preemption_mode)
_seq_ids = itertools.count()


class SimReplica:
    """One simulated replica; `publisher` (a PrefixIndexPublisher or None) is started by the
    fleet and fed here after every stretch of steps."""

    def __init__(self, replica_id: str, timing: TimingModel, publisher: Any = None, *,
                 max_loras: int = 8, lora_load_s: float = 0.05,
                 preemption_mode: str = "auto") -> None:
        if preemption_mode not in PREEMPTION_MODES:
            raise ValueError(f"preemption_mode {preemption_mode!r}: expected one of "
                             f"{PREEMPTION_MODES}")
        self.replica_id, self.timing, self.publisher = replica_id, timing, publisher
        self.preemption_mode = preemption_mode
        self._adapters = ResidentAdapters(max_loras, lora_load_s)
        self.scheduler = self._new_scheduler()
        self._requests: dict[int, SimRequest] = {}  # seq_id -> the request, until finished
        self.counters = ReplicaCounters()
        self._wake = asyncio.Event()
        self._task: asyncio.Task | None = None

    def _new_scheduler(self) -> Scheduler:
        t = self.timing
        kv = KVCacheManager(t.num_blocks, t.block_size, num_cpu_blocks=t.num_cpu_blocks)
        config = SchedulerConfig(max_num_seqs=t.max_num_seqs,
                                 max_num_batched_tokens=t.max_num_batched_tokens,
                                 max_model_len=t.num_blocks * t.block_size,
                                 preemption_mode=self.preemption_mode)
        return Scheduler(config, kv, swap_advisor=t)  # "auto" asks the timing model's rates

    # ---- the scheduler's state, as the fleet, the oracle and the tests read it ---------------
    @property
    def kv(self) -> KVCacheManager:
        return self.scheduler.kv

    @property
    def waiting(self) -> list[Sequence]:
        return list(self.scheduler.waiting)

    @property
    def running(self) -> list[Sequence]:
        return self.scheduler.running

    @property
    def swapped(self) -> list[Sequence]:
        return list(self.scheduler.swapped)

    @property
    def adapters(self) -> dict[str, str]:
        """Resident adapters, name -> path, least recently used first."""
        return self._adapters.paths

    # ---- lifecycle ----------------------------------------------------------------------------
    def start(self) -> None:
        self._task = asyncio.create_task(self._loop(), name=f"sim-{self.replica_id}")
        self._publish()

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
            self._task = None
        for req in list(self._requests.values()):
            self._drop(req, "replica stopped")

    def reset(self) -> None:
        """Forget every cached block, adapter and counter (between benchmark runs); needs an idle
        replica. The publisher replaces the replica's sets with the empty snapshot."""
        if self.scheduler.has_unfinished():
            raise RuntimeError(f"replica {self.replica_id} is busy; reset it when idle")
        self.scheduler = self._new_scheduler()
        self.counters = ReplicaCounters()
        self._adapters.clear()
        if self.publisher is not None:
            self.publisher.on_step([], self.load(), snapshot=[], host_snapshot=[])

    # ---- requests -----------------------------------------------------------------------------
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
            self._adapters.acquire(lora)
            self.counters.adapter_requests += 1
        self._requests[seq.seq_id] = req
        self.scheduler.add(seq)
        self.counters.requests += 1
        self._wake.set()
        return req

    def abort(self, req: SimRequest) -> None:
        if not req.finished:
            self._drop(req, "aborted")

    def _drop(self, req: SimRequest, error: str) -> None:
        """Retire an unfinished request from the scheduler (its blocks freed) with `error`."""
        if not req.seq.is_finished:
            self.scheduler.finish(req.seq)
        self._finish(req, error)

    async def load_adapter(self, name: str, path: str) -> bool:
        """Load `name` after the load delay; False when it was resident already."""
        evicted = await self._adapters.load(name, path)
        if evicted is None:
            return False
        self.counters.adapter_loads += 1
        self.counters.adapter_evictions += evicted
        self._publish()
        return True

    def unload_adapter(self, name: str) -> None:
        """AdapterNotFoundError when it is not resident."""
        self._adapters.unload(name)
        self._publish()

    def resident_adapters(self) -> list[str]:
        """What the heartbeat publishes."""
        return list(self.adapters)

    def load(self) -> SimLoad:
        s = self.scheduler
        return SimLoad(len(s.running), len(s.waiting) + len(s.swapped), self.kv.usage())

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
        left = sum(s.num_tokens - s.num_computed_tokens for s in self.scheduler.running
                   if not _is_decoding(s, s.num_tokens - s.num_computed_tokens))
        return left + sum(s.num_tokens for s in self.scheduler.waiting)

    # ---- the step loop ------------------------------------------------------------------------
    async def _loop(self) -> None:
        while True:
            if not self.scheduler.has_unfinished():
                self._wake.clear()
                await self._wake.wait()
            out = self._schedule()
            if out.is_empty:
                if not out.num_preempted and not self._refuse_unfittable():
                    self._wake.clear()  # the head of the queue waits for blocks no one frees
                    await self._wake.wait()
                continue
            if all(_is_decoding(s, n) for s, n in zip(out.seqs, out.num_tokens)):
                await self._decode_stretch(out)
            else:
                await self._step(out)
            self._publish()

    def _schedule(self) -> SchedulerOutput:
        """The scheduler's next batch; its preemptions and swaps counted."""
        swapped = len(self.scheduler.swapped)
        out = self.scheduler.schedule()
        self.counters.preemptions += out.num_preempted
        if out.num_preempted:  # no swap-in in a step that preempted: the growth is swap-outs
            self.counters.swaps += len(self.scheduler.swapped) - swapped
        return out

    def _refuse_unfittable(self) -> bool:
        """Nothing runs and the head of the queue still finds no room: it can never run."""
        s = self.scheduler
        if s.running or s.swapped or not s.waiting:
            return False
        self._drop(self._requests[s.waiting[0].seq_id], "does not fit the KV cache")
        return True

    async def _step(self, out: SchedulerOutput) -> None:
        """One step with prefill in it: its cost slept, then its output applied."""
        prefill = decoding = context = 0
        for seq, n in zip(out.seqs, out.num_tokens):
            if _is_decoding(seq, n):
                decoding, context = decoding + 1, context + seq.num_tokens
            else:
                prefill += n
        dt = self.timing.step_seconds(prefill, decoding, context) + self._swap_seconds(out)
        await asyncio.sleep(dt)
        self.counters.busy_s += dt
        now = sim_now()
        for seq, n in zip(out.seqs, out.num_tokens):
            self._advance(seq, n, now)

    async def _decode_stretch(self, out: SchedulerOutput) -> None:
        """The scheduled decode step and its repeats until the first sequence finishes or the
        pool runs short, cut short by an arrival."""
        seqs = list(out.seqs)
        steps = self._steps_that_fit(seqs, min(self._requests[s.seq_id].max_tokens
                                               - len(s.output_token_ids) for s in seqs))
        dt = self.timing.step_seconds(0, len(seqs), sum(s.num_tokens for s in seqs))
        swap_s = self._swap_seconds(out)
        if swap_s:  # the copies of a swap-in delay the first step of the stretch
            await asyncio.sleep(swap_s)
            self.counters.busy_s += swap_s
        self._wake.clear()
        t0 = sim_now()
        try:  # not asyncio.wait_for: on 3.11 it can swallow a cancel
            async with asyncio.timeout(steps * dt):
                await self._wake.wait()
        except TimeoutError:
            pass
        else:  # an arrival: finish the step in progress, then let it in
            done = min(max(math.ceil((sim_now() - t0) / dt), 1), steps) if dt else steps
            rest = done * dt - (sim_now() - t0)
            if rest > 0:
                await asyncio.sleep(rest)
            steps = done
        self.counters.busy_s += steps * dt
        now = sim_now()
        for seq in seqs:
            if not seq.is_finished and self.kv.allocate_slots(seq, steps):  # fits: checked
                self._advance(seq, steps, now)

    def _steps_that_fit(self, seqs: list[Sequence], steps: int) -> int:
        """The most decode steps (1 to `steps`) whose new blocks the free pool holds: the
        stretch ends before the step where the scheduler would preempt, which runs alone."""
        bs, free = self.kv.block_size, self.kv.num_free_blocks

        def fits(k: int) -> bool:
            return sum(max(-(-(s.num_computed_tokens + k) // bs) - self.kv.num_blocks_of(s), 0)
                       for s in seqs) <= free

        lo, hi = 1, max(steps, 1)  # fits(1): the scheduler allocated the first step's slots
        while lo < hi:
            mid = (lo + hi + 1) // 2
            lo, hi = (mid, hi) if fits(mid) else (lo, mid - 1)
        return lo

    def _swap_seconds(self, out: SchedulerOutput) -> float:
        """The cost of the blocks the step swaps out or in."""
        blocks = len(out.blocks_to_swap_out) + len(out.blocks_to_swap_in)
        return blocks * self.timing.swap_s_per_block

    def _advance(self, seq: Sequence, n: int, now: float) -> None:
        """`n` computed tokens of `seq` (its full blocks cached, as the engine's step update
        does); a token per step once its prompt is computed. Skips a seq aborted meanwhile."""
        req = self._requests.get(seq.seq_id)
        if req is None or seq.is_finished:
            return
        if req.cached_tokens < 0 and seq.num_cached_tokens >= 0:  # first admission
            req.cached_tokens = seq.num_cached_tokens
            self.counters.prompt_tokens += seq.num_prompt_tokens
            self.counters.cached_tokens += req.cached_tokens
        was_prefill = seq.num_tokens - seq.num_computed_tokens > 1 or not seq.output_token_ids
        seq.num_computed_tokens += n
        if seq.num_computed_tokens < seq.num_tokens:  # a chunk of a longer prompt
            self.kv.register_computed(seq)
            return
        # the tokens first: a decode stretch's computed count runs ahead of the tokens known
        seq.output_token_ids.extend([_OUTPUT_TOKEN] * (1 if was_prefill else n))
        self.kv.register_computed(seq)
        self._emit(req, 1 if was_prefill else n, now)

    def _emit(self, req: SimRequest, n: int, now: float) -> None:
        """`n` new tokens (already appended to the seq) to the request's stream."""
        if req.first_token_at is None:
            req.first_token_at = now
        req.events.put_nowait(n)
        if req.num_output_tokens >= req.max_tokens:
            self.scheduler.finish(req.seq)
            self.counters.finished += 1
            self._finish(req)

    def _finish(self, req: SimRequest, error: str | None = None) -> None:
        if req.finished:
            return
        req.finished, req.error = True, error
        self._requests.pop(req.seq.seq_id, None)
        if req.lora is not None:
            self._adapters.release(req.lora)
        req.events.put_nowait(None)

    def _publish(self) -> None:
        self.kv.take_alloc_seconds()  # the engine's step timer reads these; nothing here does
        pub = self.publisher
        if pub is None:
            return
        events = self.kv.pool.drain_events()
        if pub.wants_snapshot():
            pub.on_step(events, self.load(), snapshot=self.kv.pool.cached_hashes(),
                        host_snapshot=[])
        else:
            pub.on_step(events, self.load())


def _is_decoding(seq: Sequence, n: int) -> bool:
    """A decode: one token after the seq's outputs began (not a prompt chunk, nor a recompute)."""
    return n == 1 and bool(seq.output_token_ids) and seq.num_tokens - seq.num_computed_tokens == 1
