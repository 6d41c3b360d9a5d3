"""Scheduler: continuous batching. Each step it keeps the running sequences going (decode or the
next chunk of a long prompt), admits waiting ones FCFS within the token budget, and preempts the
newest running sequence (recompute or swap; "auto" asks the swap cost model) when the KV cache
runs out of blocks."""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Any, Protocol

from kvserve.engine.core.beam_group import future_beams, group_fits, members
from kvserve.engine.core.kv_cache_manager import DiskHit, HostHit, KVCacheManager, Spill
from kvserve.engine.core.scheduling_policy import add_waiting, order_key, victim
from kvserve.engine.core.sequence import Sequence, SequenceStatus


@dataclass
class SchedulerOutput:
    seqs: list[Sequence] = field(default_factory=list)  # in batch order
    num_tokens: list[int] = field(default_factory=list)  # new tokens per seq this step
    blocks_to_copy: list[tuple[int, int]] = field(default_factory=list)  # copy-on-write
    blocks_to_swap_out: list[tuple[int, int]] = field(default_factory=list)  # (device, cpu)
    blocks_to_swap_in: list[tuple[int, int]] = field(default_factory=list)  # (cpu, device)
    blocks_to_offload: list[tuple[int, int]] = field(default_factory=list)  # (device, host)
    blocks_to_restore: list[tuple[int, int]] = field(default_factory=list)  # (host, device)
    blocks_to_spill: list[Spill] = field(default_factory=list)  # -> disk tier
    blocks_to_load: list[tuple[bytearray, int]] = field(default_factory=list)  # (disk, device)
    num_preempted: int = 0
    kv_connector_metadata: Any = None  # the KV connector's work for the worker side
    # per seq, the drafted tokens scored after its last one ([]: no seq has any); set by the
    # engine core from the seqs' spec_token_ids (engine/spec_decode/speculator.py)
    spec_token_ids: list[list[int]] = field(default_factory=list)

    @property
    def is_empty(self) -> bool:
        return not self.seqs

    @property
    def total_tokens(self) -> int:
        return sum(self.num_tokens)


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int
    max_num_batched_tokens: int
    max_model_len: int
    enable_chunked_prefill: bool = True
    preemption_mode: str = "recompute"  # "recompute" | "swap" | "auto"
    policy: str = "fcfs"  # engine/core/scheduling_policy.py
    max_loras: int = 0  # LoRA adapters among the running seqs at most (0: no LoRA)


class SwapAdvisor(Protocol):
    def prefer_swap(self, num_blocks: int, num_tokens: int) -> bool: ...


class Scheduler:
    def __init__(self, config: SchedulerConfig, kv: KVCacheManager,
                 swap_advisor: SwapAdvisor | None = None) -> None:
        self.config = config
        self.kv = kv
        self.swap_advisor = swap_advisor  # "auto" preemption: swap only where it is cheaper
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.swapped: deque[Sequence] = deque()
        self.num_preemptions = 0
        # A KV connector's scheduler side (engine/kv_transfer/), and the blocks of finished
        # requests it keeps until the worker side says they were sent: request id -> blocks.
        self.connector: Any = None
        self.held_blocks: dict[str, list[Any]] = {}

    def add(self, seq: Sequence) -> None:
        seq.status = SequenceStatus.WAITING
        add_waiting(self.waiting, seq, self.config.policy)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running or self.swapped)

    def schedule(self, lookahead_skip: set[int] | None = None) -> SchedulerOutput:
        """The next step's batch. `lookahead_skip` (async scheduling: the previous step is
        still in flight) schedules without preempting or swapping in, leaving out the seqs
        whose ids it holds (the step in flight surely finishes them)."""
        out = SchedulerOutput()
        budget = self.config.max_num_batched_tokens
        self.kv.report_load(bool(self.waiting))  # a pool shared by models (shared_pool.py)
        if lookahead_skip is not None:
            budget, complete = self._schedule_running_ahead(out, budget, lookahead_skip)
            if complete and not self.swapped:
                self._schedule_waiting(out, budget)
        else:
            budget = self._schedule_running(out, budget)
            if out.num_preempted == 0:
                budget = self._schedule_swapped(out, budget)
                if not self.swapped:
                    self._schedule_waiting(out, budget)
            self._release_stalled_beams(out)
        out.blocks_to_copy = self.kv.take_pending_copies()
        out.blocks_to_offload, out.blocks_to_restore = self.kv.take_tier_moves()
        out.blocks_to_spill, out.blocks_to_load = self.kv.take_disk_moves()
        if self.connector is not None:
            out.kv_connector_metadata = self.connector.build_connector_meta(out)
        return out

    def free_sent(self, request_ids: set[str] | None) -> None:
        """Free the held blocks of finished requests the connector has sent (or given up)."""
        for rid in request_ids or ():
            blocks = self.held_blocks.pop(rid, None)
            if blocks:
                self.kv.pool.free_blocks(blocks)

    def _external_tokens(self, seq: Sequence, num_cached: int) -> int | None:
        """Prompt tokens past the local `num_cached` the KV connector supplies (None: it is
        still pulling them; the seq waits without blocking the queue)."""
        if self.connector is None or seq.group is not None or seq.prompt_embeds is not None:
            return 0
        n, _ = self.connector.get_num_new_matched_tokens(seq, num_cached)
        return n

    def _schedule_running(self, out: SchedulerOutput, budget: int) -> int:
        if self.config.policy != "fcfs":
            self.running.sort(key=order_key)  # the most urgent get the token budget first
        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            n = seq.num_tokens - seq.num_computed_tokens
            if n == 1:  # decoding: room for its drafts too (speculative decoding)
                n += len(seq.spec_token_ids)
            n = min(n, budget)
            if n == 0:  # a beam whose group waits for its other beams: nothing to compute
                i += 1
                continue
            while not self.kv.allocate_slots(seq, n):
                # a beam search's running beams go together (engine/core/beam_group.py)
                evicted = [s for s in members(victim(self.running, self.config.policy))
                           if s.status == SequenceStatus.RUNNING]
                # already scheduled: the loop shifts back
                i -= sum(1 for s in evicted if self.running.index(s) < i)
                for s in evicted:
                    self._preempt(s, out)
                if seq in evicted:
                    break
            else:
                out.seqs.append(seq)
                out.num_tokens.append(n)
                budget -= n
                i += 1
        return budget

    def _release_stalled_beams(self, out: SchedulerOutput) -> None:
        """A step that schedules nothing while beams wait, holding blocks, for siblings the
        pool cannot admit would repeat forever: those beams go back to the waiting queue
        (recompute; their blocks stay in the prefix cache), so the group comes back whole."""
        if out.seqs or not self.waiting:
            return
        stalled = [s for s in self.running if s.group is not None]
        for seq in reversed(stalled):
            self._preempt(seq, out)

    def _schedule_running_ahead(self, out: SchedulerOutput, budget: int, skip: set[int]
                                ) -> tuple[int, bool]:
        """`_schedule_running` that never preempts: a seq whose token is still in flight must
        keep its blocks. Stops at the first seq the pool cannot serve (False: the waiting queue
        must not take blocks ahead of it)."""
        if self.config.policy != "fcfs":
            self.running.sort(key=order_key)
        for seq in self.running:
            if budget <= 0:
                break
            if seq.seq_id in skip:
                continue
            n = min(seq.num_tokens - seq.num_computed_tokens, budget)
            if not self.kv.allocate_slots(seq, n):
                return budget, False
            out.seqs.append(seq)
            out.num_tokens.append(n)
            budget -= n
        return budget, True

    def _preempt(self, seq: Sequence, out: SchedulerOutput) -> None:
        """Evict the newest running seq: swap its blocks out, or free them to recompute later."""
        self.running.remove(seq)
        seq.num_preemptions += 1
        self.num_preemptions += 1
        out.num_preempted += 1
        if seq in out.seqs:  # it had been scheduled earlier this step: undo that
            k = out.seqs.index(seq)
            del out.seqs[k], out.num_tokens[k]
        if self._should_swap(seq):
            out.blocks_to_swap_out += self.kv.swap_out(seq)
            seq.status = SequenceStatus.SWAPPED
            self.swapped.appendleft(seq)
            return
        self.kv.free(seq)
        seq.num_computed_tokens = 0
        seq.status = SequenceStatus.WAITING
        add_waiting(self.waiting, seq, self.config.policy, front=True)

    def preempt_running(self) -> int:
        """Preempt every running seq by recompute (their blocks freed; vLLM's
        `reset_prefix_cache(reset_running_requests=True)`); returns how many."""
        seqs = list(self.running)
        for seq in reversed(seqs):  # the oldest ends up first in the waiting queue
            self.running.remove(seq)
            seq.num_preemptions += 1
            self.num_preemptions += 1
            self.kv.free(seq)
            seq.num_computed_tokens = 0
            seq.status = SequenceStatus.WAITING
            add_waiting(self.waiting, seq, self.config.policy, front=True)
        return len(seqs)

    def _should_swap(self, seq: Sequence) -> bool:
        """swap: whenever the CPU pool has room; auto: when it has room and the cost model
        says copying the seq's blocks out and back beats recomputing its tokens."""
        mode = self.config.preemption_mode
        # A beam group recomputes: swapping copies each beam's blocks out, shared ones again
        # for every beam, and brings the beams back one by one.
        if mode == "recompute" or seq.group is not None or not self.kv.can_swap_out(seq):
            return False
        if mode == "swap" or self.swap_advisor is None:
            return True
        return self.swap_advisor.prefer_swap(self.kv.num_blocks_of(seq), seq.num_computed_tokens)

    def _pending_hashes(self, out: SchedulerOutput) -> set[bytes]:
        """Hashes of the full blocks the already scheduled sequences compute this step."""
        bs = self.kv.block_size
        pending: set[bytes] = set()
        for seq, n in zip(out.seqs, out.num_tokens):
            if n > 1:  # prefill chunks only; a decode token fills at most one block
                start = seq.num_computed_tokens // bs
                pending.update(self.kv.full_block_hashes(seq, start,
                                                         (seq.num_computed_tokens + n) // bs))
        return pending

    def _has_seq_room(self, seq: Sequence) -> bool:
        """Whether `seq` and the siblings it will fork after its prefill (n > 1) fit within
        max_num_seqs next to the running seqs and the forks those still owe."""
        taken = len(self.running) + sum(s.pending_forks + future_beams(s) for s in self.running)
        return taken + 1 + seq.pending_forks + future_beams(seq) <= self.config.max_num_seqs

    def running_loras(self) -> set[str]:
        """The LoRA adapters of the running seqs (each holds a device slot)."""
        return {s.lora_name for s in self.running if s.lora_name is not None}

    def _lora_fits(self, seq: Sequence, loras: set[str]) -> bool:
        """Whether `seq`'s adapter is running already or a slot is left for it (`loras` grows)."""
        if seq.lora_name is None or seq.lora_name in loras:
            return True
        if len(loras) >= self.config.max_loras:
            return False
        loras.add(seq.lora_name)
        return True

    def _schedule_swapped(self, out: SchedulerOutput, budget: int) -> int:
        loras = self.running_loras()
        while self.swapped and budget > 0 and self._has_seq_room(self.swapped[0]):
            seq = self.swapped[0]
            if not self._lora_fits(seq, loras):
                break
            n = min(seq.num_tokens - seq.num_computed_tokens, budget)
            # Room for its next tokens too: swapped in without it, it would be swapped out again.
            if not self.kv.can_swap_in(seq, n):
                break
            out.blocks_to_swap_in += self.kv.swap_in(seq)
            self.swapped.popleft()
            if not self.kv.allocate_slots(seq, n):  # resumes next step with its blocks back
                seq.status = SequenceStatus.RUNNING
                self.running.append(seq)
                break
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            out.seqs.append(seq)
            out.num_tokens.append(n)
            budget -= n
        return budget

    def _schedule_waiting(self, out: SchedulerOutput, budget: int) -> None:
        # Block hashes that sequences scheduled this step are about to compute. A waiting seq
        # whose next uncached block is among them sits out this one step (keeping its place at
        # the head of the queue) and then hits the cache instead of computing the same prefix
        # again: a shared system prompt is computed once, not once per request of the step.
        pending = self._pending_hashes(out)
        deferred: list[Sequence] = []
        loras = self.running_loras()
        while self.waiting and budget > 0 and self._has_seq_room(self.waiting[0]) \
                and self.kv.may_admit():
            seq = self.waiting[0]
            # a beam group comes back whole; with nothing running, waiting frees nothing
            if self.running and not group_fits(seq, self.waiting, self.kv.pool.num_free_blocks,
                                               self.kv.block_size):
                break
            if not self._lora_fits(seq, set(loras)):  # its adapter waits for a free slot
                deferred.append(self.waiting.popleft())
                continue
            # A seq still owed prompt logprobs computes its whole prompt: a cached block has
            # no hidden states (engine/sample/prompt_logprobs.py), so waiting for one gains nothing.
            owed = seq.wants_prompt_logprobs
            hits = [] if owed else self.kv.lookup_prefix(seq)
            nxt = [] if owed else self.kv.full_block_hashes(seq, len(hits), len(hits) + 1)
            if nxt and nxt[0] in pending and seq.group is None:  # a beam group comes in whole
                deferred.append(self.waiting.popleft())
                continue
            ext = 0 if owed else self._external_tokens(seq, len(hits) * self.kv.block_size)
            if ext is None:
                deferred.append(self.waiting.popleft())
                continue
            if ext:
                hits = list(hits) + self.kv.external_hits(seq, len(hits),
                                                          ext // self.kv.block_size)
            cached = len(hits) * self.kv.block_size
            n = seq.num_tokens - cached
            if n > budget and not self.config.enable_chunked_prefill:
                break
            n = min(n, budget)
            if not self.kv.allocate_slots(seq, n, hits):
                break
            self.waiting.popleft()
            from_host = sum(1 for h in hits if isinstance(h, HostHit)) * self.kv.block_size
            from_disk = sum(1 for h in hits if isinstance(h, DiskHit)) * self.kv.block_size
            if not owed:
                self.kv.record_lookup(seq.num_tokens, cached - ext, from_host, from_disk)
            if self.connector is not None and not owed:
                self.kv.record_external(seq.num_tokens, ext)
            if ext:
                first = len(hits) - ext // self.kv.block_size
                self.connector.update_state_after_alloc(
                    seq, self.kv.block_ids(seq)[first:len(hits)], ext)
            if seq.num_cached_tokens < 0:  # first admission: what the request got from the cache
                seq.num_cached_tokens = cached
            seq.num_computed_tokens = cached
            seq.status = SequenceStatus.RUNNING
            pending.update(self.kv.full_block_hashes(
                seq, len(hits), (cached + n) // self.kv.block_size))
            self.running.append(seq)
            if seq.lora_name is not None:
                loras.add(seq.lora_name)
            out.seqs.append(seq)
            out.num_tokens.append(n)
            budget -= n
        self.waiting.extendleft(reversed(deferred))

    def finish(self, seq: Sequence) -> None:
        """Retire a finished or aborted seq from whichever queue holds it; free its blocks."""
        if seq.status == SequenceStatus.RUNNING:
            self.running.remove(seq)
        elif seq.status == SequenceStatus.WAITING:
            self.waiting.remove(seq)
        elif seq.status == SequenceStatus.SWAPPED:
            self.swapped.remove(seq)
        if self.connector is not None and seq.index == 0:
            self._connector_finished(seq)
        self.kv.free(seq)
        seq.status = SequenceStatus.FINISHED

    def _connector_finished(self, seq: Sequence) -> None:
        """Ask the connector whether the seq's blocks outlive it (a prefill replica's, until the
        decode replica has pulled them): then they are held, its params kept for the output."""
        blocks = self.kv.held_blocks(seq) if seq.status != SequenceStatus.SWAPPED else []
        keep, params = self.connector.request_finished(seq, [b.block_id for b in blocks])
        seq.kv_transfer_params = params
        if keep and blocks:
            self.kv.pool.touch(blocks)  # one more reference: kv.free leaves them held
            self.held_blocks[seq.request_id] = blocks

    def add_running(self, seq: Sequence) -> None:
        """A forked sibling joins the running set directly (its blocks are shared)."""
        seq.status = SequenceStatus.RUNNING
        self.running.append(seq)
