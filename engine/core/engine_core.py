"""EngineCore (vLLM v1's): the scheduler, the KV cache and the model runner, and the step that
joins them: schedule -> execute -> update from output. It takes requests the processor checked
(engine/processor.py) and returns the requests that moved; the front (engine/llm_engine.py)
turns them into RequestOutputs (engine/output_processor.py). Not thread-safe: one thread steps.

Where the next pieces go: a proposer between `execute_model`'s forward and `update_from_output`,
a KV connector around `schedule` and `execute_model`, a pipeline stage inside the runner."""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Iterable
from typing import Any

from kvserve.engine.async_scheduling import OverlappedStep
from kvserve.engine.async_scheduling import enabled as async_scheduling_enabled
from kvserve.engine.config import EngineConfig
from kvserve.engine.core.beam_group import BeamGroup, beam_eos
from kvserve.engine.core.core_figures import cached_block_hashes, engine_stats, plain_events
from kvserve.engine.core.core_setup import (
    calibrate_kv_scales,
    seat_setup,
    seat_view,
    capture_decode_graphs,
    disk_tier,
    log_start,
    logits_processors,
    make_runner,
    make_scheduler,
    persist_to_disk,
)
from kvserve.engine.core.kv_cache_manager import KVCacheManager
from kvserve.engine.core.kv_events import KVEvent
from kvserve.engine.core.request import NewRequest, RequestState
from kvserve.engine.core.sampling_inputs import logits_hook, sampling_rows
from kvserve.engine.core.scheduler import SchedulerOutput
from kvserve.engine.core.sequence import Sequence, SequenceStatus
from kvserve.engine.core.step_update import apply_samples
from kvserve.engine.kv_offload.swap_cost import SwapCostModel
from kvserve.engine.kv_transfer.factory import engine_connectors
from kvserve.engine.outputs import RequestMetrics
from kvserve.engine.profiler import TorchProfiler
from kvserve.engine.sample.beam_search import is_beam
from kvserve.engine.sample.continuation import Continuation, prime
from kvserve.engine.sample.prompt_logprobs import append_entries
from kvserve.engine.sample.prompt_logprobs import plan as plan_prompt_logprobs
from kvserve.engine.sample.sampler import SamplerOutput
from kvserve.engine.sample.tokenizer import load_tokenizer
from kvserve.engine.spec_decode.speculator import Speculator, make_speculator
from kvserve.engine.stats import EngineStats, TierFigures
from kvserve.engine.structured_output.grammar import GrammarCompiler
from kvserve.engine.worker.model_loader import load_model, resolve_model
from kvserve.engine.worker.startup import EngineSetup, set_up
from kvserve.kernels.fp8 import FP8_DTYPE
from kvserve.lora.engine_loras import EngineLoRAs

logger = logging.getLogger("kvserve.engine")


class ModelStep:
    """What `execute_model` launched: the sampled rows and the sampler's (unread) output."""

    def __init__(self, rows: list[int], result: SamplerOutput | None, prompt_plan: Any,
                 prompt_result: Any) -> None:
        self.rows, self.result = rows, result
        self.prompt_plan, self.prompt_result = prompt_plan, prompt_result
        self.spec: Any = None  # speculative decoding's SpecPlan (engine/spec_decode/)
        self.starts: list[int] = []  # each seq's computed count before the step


class EngineCore:
    def __init__(self, config: EngineConfig, seat: Any = None) -> None:
        self.config = config
        # `seat` (worker/kv_region.PoolSeat): this model's place on a KV pool shared with other
        # models of this process; None: a pool of its own.
        self.seat = seat
        self.model_path = resolve_model(config.model, config.revision)
        setup: EngineSetup = set_up(config, self.model_path, load_model)
        if seat is not None:
            setup = seat_setup(config, setup, seat)
        self.device, self.dtype, self.hf_config = setup.device, setup.dtype, setup.hf_config
        self.tokenizer = load_tokenizer(config.tokenizer or self.model_path,
                                        config.trust_remote_code)
        self.max_model_len, self.block_size = setup.max_model_len, config.block_size
        self.memory_budget = setup.budget
        self.host_plan = setup.host_plan  # the whole server's memory on this host (None: dry run)
        self.eos_token_ids, self.vocab_size = setup.eos_token_ids, setup.vocab_size
        self._build_parts(config, setup)
        self.grammars = GrammarCompiler(self.tokenizer, self.vocab_size, self.eos_token_ids,
                                        backend=config.structured_outputs_backend)
        self.logits_processors = logits_processors(config, self.device)
        self.spec = make_speculator(self)  # speculative decoding (None: off)
        # Set by `LLM` while it drains its own requests: none can arrive meanwhile (the
        # speculative mode chooser judges such a batch's tail by its slowest request).
        self.arrivals_closed = False
        self.requests: dict[str, RequestState] = {}
        self.pending: list[RequestState] = []  # aborted or drained: the next step returns them
        self.errors: dict[str, BaseException] = {}  # requests that failed alone, not yet taken
        self.failed_now: set[str] = set()  # ... of them, those that failed in this step
        self.prompt_tokens = self.generation_tokens = 0
        self.prompt_tokens_computed = 0  # prompt positions run through the model (not cached)
        self._next_seq_id = 0
        self.profiler = TorchProfiler(config.profiler_config)
        self.async_scheduling = async_scheduling_enabled(config.async_scheduling, self)
        self.stepper = OverlappedStep(self, overlap=self.async_scheduling)
        self.model_weight_bytes = setup.budget.weight_bytes * config.tensor_parallel_size
        log_start(self, setup)

    def _build_parts(self, config: EngineConfig, setup: EngineSetup) -> None:
        """The KV cache (and its tiers), the scheduler, the model runner and the adapters."""
        self.disk = disk_tier(config, setup, str(self.model_path))
        seat = self.seat
        self.kv = KVCacheManager(setup.budget.num_blocks, config.block_size,
                                 config.enable_prefix_caching, setup.num_cpu_blocks,
                                 setup.num_host_blocks, self.disk, setup.kv_groups,
                                 **({} if seat is None else {
                                     "shared": seat.shared.pool, "member": seat.member,
                                     "model_key": seat.model_key}))
        self.swap_cost = SwapCostModel(setup.budget.bytes_per_block)
        self.scheduler = make_scheduler(config, setup, self.kv, self.swap_cost)
        self.runner = make_runner(config, setup, self.disk, seat_view(setup, seat))
        self.tiers = TierFigures()
        self.kv_connector = engine_connectors(config, self.runner, setup.kv_groups,
                                              setup.hf_config)
        if self.kv_connector is not None:  # (scheduler side, worker side)
            self.scheduler.connector = self.kv_connector[0]
            self.runner.attach_kv_connector(self.kv_connector[1])
        self.loras = EngineLoRAs.create(config, self.runner)
        if config.calculate_kv_scales and setup.kv_dtype == FP8_DTYPE:
            calibrate_kv_scales(self)
        # Captured batches are planned once, with no host look at their lengths: Triton only.
        # Tensor-parallel engines capture on every rank; LoRA slots are step inputs like the rest.
        if self.device.type == "cuda" and not config.enforce_eager \
                and self.runner.backend == "triton" and config.pipeline_parallel_size == 1:
            capture_decode_graphs(self)

    # ---- requests -----------------------------------------------------------------------------
    def add_request(self, req: NewRequest) -> None:
        """Queue a checked request (engine/processor.py) as its first sequence; n > 1 siblings
        fork from it once its prompt is computed."""
        seq = self.new_seq(req.request_id, 0, req.prompt_token_ids, req.params,
                           req.arrival_time, req.priority, req.cache_salt, req.lora_name)
        seq.pending_forks = req.params.n - 1
        seq.prompt_embeds = req.prompt_embeds
        self.requests[req.request_id] = RequestState(
            req.request_id, req.prompt, req.prompt_token_ids, req.params, [seq],
            [req.new_text()], RequestMetrics(arrival_time=req.arrival_time),
            grammar=req.grammar, best_of=req.best_of, makes_text=req.makes_text,
            lora_request=req.lora_request, new_text=req.new_text,
            prompt_embeds=req.prompt_embeds)
        if is_beam(req.params):  # its seqs are beams, chosen together (core/beam_group.py)
            seq.group = self.requests[req.request_id].beam = BeamGroup(
                self.requests[req.request_id], req.params, beam_eos(self))
        self.prompt_tokens += len(req.prompt_token_ids)
        if req.continuation is not None and self._continue(req.continuation, seq):
            return
        self.scheduler.add(seq)

    def _continue(self, cont: Continuation, seq: Sequence) -> bool:
        """Give the seq its continuation as output (prefilled with the prompt, counted toward
        min_tokens and max_tokens; its text primes the tracker); True when that already ends
        it by length: the next step returns it finished, with no new token."""
        state = self.requests[seq.request_id]
        seq.output_token_ids = list(cont.token_ids)
        state.first_index, state.skip_tokens = cont.index, len(cont.token_ids)
        state.skip_chars = prime(state.detoks[0], cont.token_ids)
        if len(cont.token_ids) < seq.params.max_tokens \
                and seq.num_tokens < self.max_model_len:  # type: ignore[operator]
            return False
        seq.status, seq.finish_reason = SequenceStatus.FINISHED, "length"
        state.detoks[0].flush(seq.output_token_ids)
        state.metrics.finished_time = time.monotonic()
        self.pending.append(state)  # known (`requests`) until the next step returns it
        return True

    def new_seq(self, request_id: str, index: int, ids: list[int], params: Any, arrival: float,
                priority: int, cache_salt: str | None, lora_name: str | None = None) -> Sequence:
        self._next_seq_id += 1
        return Sequence(self._next_seq_id, request_id, index, ids, params, arrival_time=arrival,
                        priority=priority, cache_salt=cache_salt, lora_name=lora_name)

    def turn(self) -> Any:
        """The shared pool's turn (engines of one process step one at a time); else nothing."""
        return self.seat.shared.pool.lock if self.seat is not None else contextlib.nullcontext()

    def abort_requests(self, request_ids: Iterable[str]) -> None:
        """Stop requests now; their blocks go back to the pool before this call returns, and
        the next step returns them finished with reason "abort"."""
        with self.turn():
            self._abort(request_ids)

    def _abort(self, request_ids: Iterable[str]) -> None:
        for rid in list(request_ids):
            state = self.requests.pop(rid, None)
            if state is None:
                continue
            for seq in state.seqs:
                if not seq.is_finished:
                    self.scheduler.finish(seq)
                    seq.finish_reason = "abort"
            self.pending.append(state)

    def fail_request(self, request_id: str, exc: BaseException) -> None:
        """A request that failed on its own (its sampling or text): aborted after this step."""
        logger.warning("request %s failed on its own and is aborted: %r", request_id, exc)
        self.errors[request_id] = exc
        self.failed_now.add(request_id)

    def all_seqs(self) -> list[Sequence]:
        return [s for state in self.requests.values() for s in state.seqs]

    # ---- the step -----------------------------------------------------------------------------
    def step(self) -> list[RequestState]:
        """One engine step: the requests that moved (aborted ones included), each once. The
        stepper (engine/async_scheduling.py) runs `schedule`, `execute_model` and
        `update_from_output`; with async scheduling the next step's schedule and execute come
        before this step's update."""
        with self.turn():
            moved, self.pending = self.pending, []
            for state in moved:  # a continuation that ended as it was added
                if state.finished and self.requests.get(state.request_id) is state:
                    del self.requests[state.request_id]
            self.failed_now = set()
            moved += self.stepper.step()
            self.abort_requests(self.failed_now)  # returned by the next step
        return list({id(s): s for s in moved}.values())

    def schedule(self, skip: set[int] | None = None) -> SchedulerOutput | None:
        """The scheduler's next batch (`skip`: seqs the step in flight surely finishes); None
        when nothing runs (a swap-in may still precede the seq's next forward)."""
        self.poll_kv_transfers()
        if self.spec is not None and skip is None:
            self.spec.propose(self)  # drafts on the decoding seqs, for the scheduler to fit
        sched = self.scheduler.schedule(lookahead_skip=skip)
        if self.spec is not None:
            Speculator.take_drafts(sched)
        if sched.is_empty:
            self.runner.move_blocks(sched)
            self.observe_copies()
            if self.kv_connector is not None and self.scheduler.waiting:
                time.sleep(0.001)  # requests wait on KV pulls: the loop need not spin hot
            return None
        return sched

    def poll_kv_transfers(self) -> None:
        """Free the held blocks the KV connector has sent (a decode replica confirmed, or the
        abort timeout passed); each step, and on the core process's idle ticks."""
        if self.kv_connector is not None:
            sending, recving = self.runner.kv_connector.get_finished()
            self.scheduler.connector.update_connector_output(sending, recving)
            self.scheduler.free_sent(sending)

    def execute_model(self, sched: SchedulerOutput, fill: Any = None) -> ModelStep:
        """Launch the forward and the sampler for `sched` without reading the tokens back
        (`fill`: inputs the device supplies, engine/async_scheduling.py's StepFill); each
        scheduled seq's computed count moves on."""
        spec = None
        if sched.spec_token_ids:  # speculative decoding: every drafted position is sampled
            rows, _ = sampling_rows(self, sched, with_metadata=False)
            rows, sampling, spec = Speculator.expand_rows(self, sched, rows)
        else:
            rows, sampling = sampling_rows(self, sched)
        if self.logits_processors is not None:
            self.runner.logits_hook = logits_hook(self.logits_processors, sched, rows)
        prompt_plan = plan_prompt_logprobs(sched.seqs, sched.num_tokens)
        lora_slots = self.loras.slots([s.lora_name for s in sched.seqs],
                                      self.scheduler.running_loras())
        result, prompt_result = self.runner.execute(
            sched, self.kv, rows, sampling, prompt_plan, lora_slots, fill=fill,
            sample_offsets=spec.offsets if spec is not None else None)
        starts = [seq.num_computed_tokens for seq in sched.seqs]
        if prompt_result is not None:  # before the seqs move on: the plan read their progress
            append_entries(prompt_plan, prompt_result, self.tokenizer)  # type: ignore[arg-type]
        for seq, n in zip(sched.seqs, sched.num_tokens):
            self.prompt_tokens_computed += max(0, min(n, seq.num_prompt_tokens
                                                      - seq.num_computed_tokens))
            seq.num_computed_tokens += n
        step = ModelStep(rows, result, prompt_plan if prompt_result is not None else None,
                         prompt_result)
        step.spec, step.starts = spec, starts
        return step

    def update_from_output(self, sched: SchedulerOutput, step: ModelStep, tokens: list[int],
                           after: list[list[int] | None], seconds: float | None
                           ) -> list[RequestState]:
        """Apply a step's sampled `tokens` (`after`: see step_update.apply_samples); the
        requests that moved, finished ones forgotten. `seconds`: the step's time for the swap
        cost model (None: not a step's time)."""
        touched: list[RequestState] = []
        generated = self.generation_tokens
        if step.result is not None and step.spec is not None:  # a verification step
            touched = self.spec.apply(self, sched, step, tokens, time.monotonic())
        elif step.result is not None:
            touched = apply_samples(self, sched, step.rows, step.result, time.monotonic(),
                                    tokens, after)
        if self.spec is not None:
            self.spec.hidden_states(self, sched, step)
            if seconds is not None:
                self.spec.observe_step(self, sched, self.generation_tokens - generated, seconds)
        if seconds is not None:
            self.observe_step(sched, seconds)
        touched = [s for s in touched if s.request_id not in self.failed_now]
        for s in touched:
            if s.finished:
                self.requests.pop(s.request_id, None)
        return touched

    def observe_step(self, sched: SchedulerOutput, seconds: float) -> None:
        """Feed the swap cost model: prefill rate from prefill-heavy steps, copy rate from the
        step's copies (a decode step's time is per sequence, not per token, so it is left out)."""
        if sched.total_tokens >= max(2 * len(sched.seqs), self.block_size):
            self.swap_cost.observe_prefill(sched.total_tokens, seconds)
        self.observe_copies()

    def observe_copies(self) -> None:
        tp = self.config.tensor_parallel_size
        for t in self.runner.take_copy_timings():
            self.swap_cost.observe_copy(t.num_bytes, t.seconds)
            self.tiers.add(t.kind, t.num_bytes * tp, t.seconds)

    # ---- figures, the prefix cache and the engine's life ----------------------------------------
    def get_stats(self) -> EngineStats:
        return engine_stats(self)

    def cached_block_hashes(self, medium: str = "device") -> list[str]:
        """Every hash the device pool (or, `medium="host"` / "disk", that tier) holds now."""
        return cached_block_hashes(self.kv, medium)

    def drain_kv_events(self, media: tuple[str, ...]) -> list[KVEvent]:
        """Prefix-cache changes since the last call: the device pool's (what a tier-unaware
        index holds), and with "host" / "disk" in `media` those tiers' (`KVEvent.medium`).
        Each tier's log is bounded on its own when not drained."""
        if self.seat is not None and self.seat.model_key is not None:
            return []  # a shared pool's log is drained (and published) by its first model alone
        with self.turn():  # on a shared pool, another model's thread logs events too
            events = self.kv.pool.drain_events() if "device" in media else []
        if "host" in media and self.kv.host is not None:
            events += self.kv.host.drain_events()
        if "disk" in media and self.kv.disk is not None:
            events += self.kv.disk.drain_events()
        if self.kv.groups.is_hybrid:  # the router knows the plain hashes (group 0's keys) only
            events = plain_events(events)
        return events

    def reset_prefix_cache(self, reset_running_requests: bool = False) -> bool:
        """Forget every cached prefix block (device, host and disk tiers); False while running
        requests hold blocks, unless `reset_running_requests` preempts them first."""
        self.stepper.drain()
        if reset_running_requests:
            self.scheduler.preempt_running()
        if not self.kv.pool.reset_prefix_cache():
            return False
        if self.kv.host is not None:
            self.kv.host.clear()
        if self.kv.disk is not None:
            self.kv.disk.clear()
        return True

    def save_sharded_state(self, path: str, pattern: str | None = None,
                           max_size: int | None = None) -> None:
        """vLLM's: every tensor-parallel rank writes its own shard of the model to `path`
        (engine/worker/sharded_state.py); `load_format="sharded_state"` reads them back."""
        from kvserve.engine.errors import ConfigError
        from kvserve.engine.worker.sharded_state import ShardedStateLoader

        if self.config.enable_lora or self.config.quantization is not None:
            raise ConfigError("save_sharded_state saves dense models without LoRA; drop "
                              "enable_lora / quantization")
        workers = self.runner.workers
        if workers is not None:
            workers.broadcast("save_sharded", (path, pattern, max_size))
        ShardedStateLoader.save_model(self.runner.model, path, pattern, max_size, rank=0)
        if workers is not None:
            workers.wait_for("saved")

    def shutdown(self) -> None:
        """Stop the tensor-parallel workers and keep the cached blocks on the disk tier."""
        self.stepper.drain()  # a step in flight writes the KV the disk tier keeps
        if self.kv_connector is not None:
            for side in self.kv_connector:
                side.shutdown()
        if self.runner.workers is not None:
            self.runner.workers.close()
        if self.disk is not None and self.disk.is_open:
            persist_to_disk(self)
            self.disk.close()
