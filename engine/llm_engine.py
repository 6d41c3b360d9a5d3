"""LLMEngine: the synchronous engine. `add_request` queues work, `step` runs one scheduler
iteration + one forward pass and returns the outputs that moved. Not thread-safe by design: one
thread (the AsyncEngine's loop, or `LLM.generate`) drives it."""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable
from dataclasses import dataclass, field, replace
from typing import Any

import torch

from kvserve.engine.async_scheduling import PLACEHOLDER, OverlappedStep
from kvserve.engine.async_scheduling import enabled as async_scheduling_enabled
from kvserve.engine.config import EngineConfig
from kvserve.engine.core.kv_cache_groups import is_plain_key
from kvserve.engine.core.kv_cache_manager import KVCacheManager
from kvserve.engine.core.kv_events import KVEvent
from kvserve.engine.core.scheduler import Scheduler, SchedulerConfig, SchedulerOutput
from kvserve.engine.core.sequence import Sequence
from kvserve.engine.errors import ConfigError, InvalidRequestError
from kvserve.engine.kv_offload.disk_block_file import describe_layout
from kvserve.engine.kv_offload.disk_tier import DiskTier
from kvserve.engine.kv_offload.swap_cost import SwapCostModel
from kvserve.engine.outputs import CompletionOutput, Logprob, RequestMetrics, RequestOutput
from kvserve.engine.profiler import TorchProfiler
from kvserve.engine.sample.best_of import BestOf, expand, select
from kvserve.engine.sample.detokenizer import (IncrementalDetokenizer, NoText, core_makes_text,
                                               new_detokenizer)
from kvserve.engine.sample.generation_config import sampling_defaults
from kvserve.engine.sample.sampler import SamplerOutput, SamplingMetadata, make_generator
from kvserve.engine.sample.sampling_params import SamplingParams
from kvserve.engine.sample.tokenizer import load_tokenizer, prompt_token_ids
from kvserve.engine.stats import EngineStats, TierFigures
from kvserve.engine.structured_output.grammar import GrammarCompiler, GrammarState
from kvserve.engine.worker.checkpoint_size import weights_log_line
from kvserve.engine.worker.cuda_graph import eager_reason, graphs_log_line
from kvserve.engine.worker.model_loader import load_model, resolve_model
from kvserve.engine.worker.model_runner import ModelRunner
from kvserve.engine.worker.startup import EngineSetup, set_up
from kvserve.kernels.fp8 import FP8_DTYPE

logger = logging.getLogger("kvserve.engine")


@dataclass
class RequestState:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    seqs: list[Sequence]
    detoks: list[IncrementalDetokenizer | NoText]
    metrics: RequestMetrics
    generators: dict[int, torch.Generator] = field(default_factory=dict)  # sample index -> gen
    grammar: Any = None  # the compiled constraint of a structured-output request
    matchers: dict[int, GrammarState] = field(default_factory=dict)  # sample index -> matcher
    best_of: BestOf | None = None  # show only the best n of params.n candidates
    makes_text: bool = True  # False: the engine core's client detokenises (engine_core/)
    lora_request: Any = None  # the LoRARequest it runs with, shown on its outputs

    @property
    def finished(self) -> bool:
        return len(self.seqs) == self.params.n and all(s.is_finished for s in self.seqs)


class LLMEngine:
    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        model_path = resolve_model(config.model, config.revision)
        setup: EngineSetup = set_up(config, model_path, load_model)
        self.device, self.dtype = setup.device, setup.dtype
        self.hf_config = setup.hf_config
        self.model_name = config.served_model_name or config.model
        self.tokenizer = load_tokenizer(config.tokenizer or model_path, config.trust_remote_code)
        self.max_model_len = setup.max_model_len
        self.block_size = config.block_size
        self.memory_budget = setup.budget
        self.host_plan = setup.host_plan  # the whole server's memory on this host (None: dry run)
        self.eos_token_ids = setup.eos_token_ids
        self.vocab_size = setup.vocab_size
        self.disk = _disk_tier(config, setup, str(model_path))
        self.kv = KVCacheManager(setup.budget.num_blocks, config.block_size,
                                 config.enable_prefix_caching, setup.num_cpu_blocks,
                                 setup.num_host_blocks, self.disk, setup.kv_groups)
        self.swap_cost = SwapCostModel(setup.budget.bytes_per_block)
        self.scheduler = Scheduler(SchedulerConfig(
            max_num_seqs=config.max_num_seqs, max_num_batched_tokens=setup.max_num_batched_tokens,
            max_model_len=self.max_model_len, enable_chunked_prefill=config.enable_chunked_prefill,
            preemption_mode=config.preemption_mode, policy=config.scheduling_policy,
            max_loras=config.max_loras if config.enable_lora else 0), self.kv, self.swap_cost)
        self.runner = ModelRunner(
            setup.model, num_layers=setup.num_layers, num_kv_heads=setup.num_kv_heads,
            head_dim=setup.head_dim, num_blocks=setup.budget.num_blocks,
            block_size=config.block_size, kv_dtype=setup.kv_dtype, device=self.device,
            num_cpu_blocks=setup.num_cpu_blocks, attention_backend=config.attention_backend,
            workers=setup.workers, num_host_blocks=setup.num_host_blocks, disk=self.disk,
            kv_groups=setup.kv_groups)
        self.tiers = TierFigures()
        self.lora = _make_lora_manager(config, self.runner)
        if config.calculate_kv_scales and setup.kv_dtype == FP8_DTYPE:
            self._calibrate_kv_scales()
        # Captured batches are planned once, with no host look at their lengths: Triton only.
        # Tensor-parallel engines capture on every rank; LoRA slots are step inputs like the rest.
        if self.device.type == "cuda" and not config.enforce_eager \
                and self.runner.backend == "triton":
            self._capture_decode_graphs()
        # Sampling values a request leaves out (the server and LLM read them; the engine does not).
        self.sampling_defaults = sampling_defaults(model_path, config.generation_config)
        self.grammars = GrammarCompiler(self.tokenizer, self.vocab_size, self.eos_token_ids,
                                        backend=config.structured_outputs_backend)
        self.requests: dict[str, RequestState] = {}
        # False in the engine core process: its client detokenises and checks stop strings,
        # except for the requests `core_makes_text` names.
        self.detokenize = True
        self._next_seq_id = 0
        self.logits_processors = _logits_processors(config, self.device)
        self._aborted: list[RequestOutput] = []
        self._errors: dict[str, BaseException] = {}  # requests that failed alone, not yet taken
        self._failed_now: set[str] = set()  # ... of them, those that failed in this step
        self._prompt_tokens = 0
        self._generation_tokens = 0
        self._profiler = TorchProfiler()
        self.async_scheduling = async_scheduling_enabled(config.async_scheduling, self)
        self._stepper = OverlappedStep(self, overlap=self.async_scheduling)
        if self.async_scheduling:
            logger.info("async scheduling: each step is launched before the previous step's "
                        "tokens are read (--no-async-scheduling turns it off)")
        logger.info("%s; device %s, dtype %s, kv dtype %s, attention backend %s",
                    self.memory_budget.describe(), self.device, self.dtype, setup.kv_dtype,
                    self.runner.backend)
        self.model_weight_bytes = setup.budget.weight_bytes * config.tensor_parallel_size
        logger.info("%s", weights_log_line(self.model_weight_bytes, model_path,
                                           torch.finfo(self.dtype).bits // 8,
                                           config.quantization))
        if self.runner.graphs is None:  # captured graphs were logged with their sizes
            logger.info("%s", graphs_log_line(None, eager_reason(
                self.device.type, config.enforce_eager, self.runner.backend)))
        if self.kv.groups.is_hybrid or self.kv.groups.slides:
            logger.info("KV-cache groups: %s; a block is a page of %d layers, sliding groups "
                        "free blocks that left their window",
                        ", ".join(f"{len(g.layers)} layers "
                                  f"{'W=' + str(g.sliding_window) if g.sliding_window else 'full'}"
                                  for g in self.kv.groups.groups), self.kv.groups.page_layers)

    def _capture_decode_graphs(self, capture: Any = None) -> None:
        """CUDA graphs for decode (engine/worker/cuda_graph.py). A capture that fails on any
        rank (an op of this model that syncs with the host) leaves every step of every rank
        eager, said once in the log. `capture`: the CPU tests' stand-in for CUDAGraph."""
        try:
            self.runner.capture_decode_graphs(self.config.max_num_seqs, self.max_model_len,
                                              capture)
        except RuntimeError as exc:
            self.runner.graphs = None
            logger.warning("CUDA graph capture failed (%s); decode runs eagerly "
                           "(--enforce-eager skips the attempt)", exc)

    def _calibrate_kv_scales(self) -> None:
        """`calculate_kv_scales=True`: FP8 scales from a representative first batch."""
        text = ("The KV cache stores the keys and values of every token seen so far. "
                "What is the capital of France? Paris is the capital of France. 0123456789")
        try:
            ids = _chat_ids(self.tokenizer, text)
        except Exception:  # noqa: BLE001 - a model without a chat template: plain text
            ids = prompt_token_ids(self.tokenizer, text)
        self.runner.calibrate_kv_scales(ids[: self.max_model_len], self.dtype)
        logger.info("fp8 KV scales from calibration: k_scale %.4g, v_scale %.4g",
                    self.runner.k_scale, self.runner.v_scale)

    @classmethod
    def from_config(cls, config: EngineConfig) -> "LLMEngine":
        return cls(config)

    @classmethod
    def from_engine_args(cls, engine_args: Any) -> "LLMEngine":
        """vLLM's constructor: an `EngineArgs` (engine/arg_utils.py) -> its engine."""
        return cls.from_config(engine_args.create_engine_config())

    def check_health(self) -> None:
        """WorkerDiedError when a tensor-parallel worker is gone (even while idle); safe to
        call from another thread (it only looks at the worker processes)."""
        if self.runner.workers is not None:
            self.runner.workers.check_alive()

    def start_profile(self) -> None:
        """Start the torch profiler around the steps (engine/profiler.py; vLLM's)."""
        self._profiler.start()

    def stop_profile(self) -> None:
        self._profiler.stop()

    def shutdown(self) -> None:
        """Stop the tensor-parallel workers (nothing to do with one rank); idempotent. Dropping
        the engine or leaving the interpreter stops them too."""
        self._stepper.drain()  # a step in flight writes the KV the disk tier keeps
        if self.runner.workers is not None:
            self.runner.workers.close()
        if self.disk is not None and self.disk.is_open:
            self._persist_to_disk()
            self.disk.close()

    def _persist_to_disk(self) -> None:
        """The host tier's and the device pool's cached blocks go to the disk tier too, so a
        restart of the same model finds whole prefixes there: their first blocks are the
        hottest, so they are rarely on disk while the engine runs."""
        host = self.runner.host
        blocks = [(h, slot, False) for h, slot in self.kv.host.slots.items()]  # type: ignore
        blocks += [(h, b.block_id, True) for h, b in self.kv.pool.cached.items()]
        for h, index, from_device in blocks:
            if h not in self.disk:  # type: ignore[operator]
                data = host.read_block(index, from_device=from_device)  # type: ignore[union-attr]
                self.disk.put(h, bytearray(data.numpy()), wait=True)  # type: ignore[union-attr]

    # ---- requests -----------------------------------------------------------------------------
    def add_request(self, request_id: str, prompt: str | list[int], params: SamplingParams, *,
                    arrival_time: float | None = None, priority: int = 0,
                    cache_salt: str | None = None, lora_request: Any = None) -> None:
        """Queue a request; InvalidRequestError (with `.param`) if it can never be served.
        `lora_request` (a LoRARequest): the adapter it runs with, read now if not yet known."""
        if request_id in self.requests:
            raise InvalidRequestError(f"request id {request_id!r} is already in use", "request_id")
        if priority != 0 and self.config.scheduling_policy != "priority":
            raise InvalidRequestError(
                f"priority {priority} needs the priority scheduling policy "
                "(--scheduling-policy priority); this engine serves first come, first served",
                "priority")
        lora_name = self._lora_for(lora_request)
        text = prompt if isinstance(prompt, str) else None
        ids = prompt_token_ids(self.tokenizer, prompt) if isinstance(prompt, str) else list(prompt)
        makes_text = self.detokenize or core_makes_text(params)
        params, best_of = expand(params)
        params = self._check_request(ids, params)
        grammar = self.grammars.compile(params.constraint) if params.constraint else None
        now = arrival_time if arrival_time is not None else time.monotonic()
        seq = self._new_seq(request_id, 0, ids, params, now, priority, cache_salt, lora_name)
        seq.pending_forks = params.n - 1
        state = RequestState(request_id, text, ids, params, [seq],
                             [self._detok(ids, params, makes_text)],
                             RequestMetrics(arrival_time=now), grammar=grammar, best_of=best_of,
                             makes_text=makes_text, lora_request=lora_request)
        self.requests[request_id] = state
        self.scheduler.add(seq)
        self._prompt_tokens += len(ids)

    def _check_request(self, ids: list[int], params: SamplingParams) -> SamplingParams:
        params.verify()  # again: a caller may have changed a field since it was built
        if not ids:
            raise InvalidRequestError("the prompt is empty; send at least one token", "prompt")
        if min(ids) < 0 or max(ids) >= self.vocab_size:
            raise InvalidRequestError(
                f"prompt token ids must be in [0, {self.vocab_size}), got {min(ids)}..{max(ids)}",
                "prompt")
        limit = self.max_model_len
        if len(ids) >= limit:
            raise InvalidRequestError(
                f"the prompt has {len(ids)} tokens but this model's context (max_model_len) is "
                f"{limit}; shorten the prompt or start the engine with a larger max_model_len",
                "prompt")
        if params.max_tokens is None or len(ids) + params.max_tokens > limit:
            # As vLLM v1's engine: the output stops at the context (finish_reason "length");
            # the server refuses such a request with a 400 before it gets here.
            params = _replace(params, max_tokens=limit - len(ids))
        bias = [t for t in params.logit_bias or {} if t >= self.vocab_size]
        if bias:
            raise InvalidRequestError(
                f"logit_bias names token ids past the vocabulary ({self.vocab_size}): {bias[:5]}",
                "logit_bias")
        if params.n > self.config.max_num_seqs:
            raise InvalidRequestError(
                f"n={params.n} exceeds max_num_seqs {self.config.max_num_seqs}", "n")
        total = self.memory_budget.num_blocks * self.block_size
        if len(ids) + params.max_tokens > total:
            raise InvalidRequestError(
                f"this request needs up to {len(ids) + params.max_tokens} KV slots but the whole "
                f"KV cache holds {total} tokens; lower max_tokens or give the engine more KV "
                "memory (kv_cache_memory / gpu_memory_utilization)", "max_tokens")
        need = self.kv.groups.blocks_for(len(ids) + params.max_tokens, self.block_size,
                                         self.scheduler.config.max_num_batched_tokens)
        if need > self.memory_budget.num_blocks:  # several groups: pages, not token slots
            raise InvalidRequestError(
                f"this request needs up to {need} KV blocks (pages of "
                f"{self.kv.groups.page_layers} layers) but the whole KV cache holds "
                f"{self.memory_budget.num_blocks}; lower max_tokens or give the engine more KV "
                "memory (kv_cache_memory / gpu_memory_utilization)", "max_tokens")
        return params

    def _new_seq(self, request_id: str, index: int, ids: list[int], params: SamplingParams,
                 arrival: float, priority: int, cache_salt: str | None,
                 lora_name: str | None = None) -> Sequence:
        self._next_seq_id += 1
        return Sequence(self._next_seq_id, request_id, index, ids, params, arrival_time=arrival,
                        priority=priority, cache_salt=cache_salt, lora_name=lora_name)

    def _detok(self, ids: list[int], params: SamplingParams, makes_text: bool
               ) -> IncrementalDetokenizer | NoText:
        if not makes_text:
            return NoText()
        return new_detokenizer(self.tokenizer, ids, params.skip_special_tokens,
                               params.stop_strings, params.include_stop_str_in_output)

    def abort_request(self, request_ids: str | Iterable[str]) -> None:
        """Stop requests now; their blocks go back to the pool before this call returns."""
        for rid in [request_ids] if isinstance(request_ids, str) else list(request_ids):
            state = self.requests.pop(rid, None)
            if state is None:
                continue
            for seq in state.seqs:
                if not seq.is_finished:
                    self.scheduler.finish(seq)
                    seq.finish_reason = "abort"
            self._aborted.append(self._make_output(state))

    def take_request_errors(self) -> dict[str, BaseException]:
        """Requests that failed on their own in a step (request id -> the error), since the last
        call. Each was aborted, so its KV blocks are free; the other requests went on."""
        errors, self._errors = self._errors, {}
        return errors

    def _fail_request(self, request_id: str, exc: BaseException) -> None:
        logger.warning("request %s failed on its own and is aborted: %r", request_id, exc)
        self._errors[request_id] = exc
        self._failed_now.add(request_id)

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests) or bool(self._aborted)

    def get_num_unfinished_requests(self) -> int:
        return len(self.requests)

    # ---- the step -----------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """One scheduler iteration and forward pass: the outputs of the requests that moved
        (with async scheduling, those of the step launched by the previous call)."""
        return self._stepper.step()

    def _logits_hook(self, sched: SchedulerOutput, rows: list[int]) -> Any:
        """Custom logits processors over this step's rows (a row's key: its seq, fork number)."""
        seqs = [sched.seqs[i] for i in rows]
        keys = [(s.seq_id, rows[:r].count(i)) for r, (i, s) in enumerate(zip(rows, seqs))]
        procs = self.logits_processors
        return lambda logits: procs.apply(logits, keys, seqs)

    def _sampling_rows(self, sched: SchedulerOutput
                       ) -> tuple[list[int], SamplingMetadata | None]:
        """Batch indices whose logits are sampled (prefill complete); n > 1 parents repeat."""
        rows: list[int] = []
        seqs: list[Sequence] = []
        for i, (seq, n) in enumerate(zip(sched.seqs, sched.num_tokens)):
            if seq.num_computed_tokens + n == seq.num_tokens:
                for _ in range(1 + (seq.pending_forks if not seq.output_token_ids else 0)):
                    rows.append(i)
                    seqs.append(seq)
        if not rows:
            return rows, None
        for r, seq in enumerate(seqs):  # a generator that cannot be made fails its request only
            try:
                self._generator_for(seq, r, seqs)
                self._grammar_state(seq)
            except Exception as exc:  # noqa: BLE001 - handed to that request's caller
                self._fail_request(seq.request_id, exc)
        if self._failed_now:
            kept = [(i, s) for i, s in zip(rows, seqs) if s.request_id not in self._failed_now]
            rows, seqs = [i for i, _ in kept], [s for _, s in kept]
            if not rows:
                return rows, None
        gens: dict[int, torch.Generator] = {}
        for r, seq in enumerate(seqs):
            g = self._generator_for(seq, r, seqs)  # made above: cached in the request's state
            if g is not None:
                gens[r] = g
        meta = SamplingMetadata.build(
            [s.params for s in seqs], [s.prompt_token_ids for s in seqs],
            [s.output_token_ids for s in seqs], gens, self.vocab_size, self.device,
            eos_token_id=self.eos_token_ids)
        if any(self.requests[s.request_id].grammar is not None for s in seqs):
            meta.token_bitmask = self.grammars.token_bitmask([self._grammar_state(s) for s in seqs])
        return rows, meta

    def _grammar_state(self, seq: Sequence) -> GrammarState | None:
        """The seq's matcher (made on first use: a forked sibling gets its own), in step with
        its output tokens; None for an unconstrained request."""
        state = self.requests[seq.request_id]
        if state.grammar is None:
            return None
        matcher = state.matchers.get(seq.index)
        if matcher is None:
            matcher = state.matchers[seq.index] = self.grammars.matcher(state.grammar)
        matcher.sync(seq.output_token_ids)
        return matcher

    def _generator_for(self, seq: Sequence, row: int, seqs: list[Sequence]) -> torch.Generator | None:
        """Seeded requests: one generator per sample index, seeded with seed + index."""
        if seq.params.seed is None:
            return None
        state = self.requests[seq.request_id]
        repeat = sum(1 for s in seqs[:row] if s is seq)
        index = seq.index if repeat == 0 else len(state.seqs) + repeat - 1
        if index not in state.generators:
            state.generators[index] = make_generator(seq.params.seed + index, self.device)
        return state.generators[index]

    def _apply_samples(self, sched: SchedulerOutput, rows: list[int], result: SamplerOutput,
                       now: float, tokens: list[int], after: list[list[int] | None]
                       ) -> list[RequestState]:
        """Append each sampled row's token (`tokens`, read from `result`) to its seq, forking
        n > 1 siblings first; `after[r]`: placeholders of a later step in flight, put back
        behind row r's token unless it finished the seq (engine/async_scheduling.py)."""
        lps = result.logprobs.tolist() if result.logprobs is not None else None
        lp_ids = result.logprob_token_ids.tolist() if result.logprob_token_ids is not None else None
        ranks = result.sampled_token_ranks.tolist() \
            if result.sampled_token_ranks is not None else None
        # Forks first: a parent that finishes on this very token must still lend its blocks.
        targets: list[Sequence] = []
        for r, i in enumerate(rows):
            parent = sched.seqs[i]
            targets.append(self._fork(parent) if r > 0 and rows[r - 1] == i else parent)
        touched: dict[str, RequestState] = {}
        for r, (seq, tok) in enumerate(zip(targets, tokens)):
            if seq.is_finished or seq.request_id not in self.requests:
                continue  # ended (aborted, or stopped by the step before) while in flight
            state = self.requests[seq.request_id]
            try:  # detokenizing and stop checks are this request's own business
                self._append_token(state, seq, tok, lps[r] if lps else None,
                                   lp_ids[r] if lp_ids else None, now,
                                   ranks[r] if ranks else None)
            except Exception as exc:  # noqa: BLE001 - handed to that request's caller
                self._fail_request(seq.request_id, exc)
            if after[r] and not seq.is_finished:
                seq.output_token_ids += after[r]
            touched[state.request_id] = state
        return list(touched.values())

    def _fork(self, parent: Sequence) -> Sequence:
        state = self.requests[parent.request_id]
        parent.pending_forks -= 1
        child = self._new_seq(parent.request_id, len(state.seqs), parent.prompt_token_ids,
                              parent.params, parent.arrival_time, parent.priority,
                              parent.cache_salt, parent.lora_name)
        child.num_computed_tokens = parent.num_computed_tokens
        child.num_cached_tokens = parent.num_cached_tokens
        child.output_token_ids = list(parent.output_token_ids)
        self.kv.fork(parent, child)
        self.scheduler.add_running(child)
        state.seqs.append(child)
        state.detoks.append(self._detok(parent.prompt_token_ids, parent.params,
                                        state.makes_text))
        return child

    def _append_token(self, state: RequestState, seq: Sequence, tok: int,
                      lp: list[float] | None, lp_ids: list[int] | None, now: float,
                      rank: int | None = None) -> None:
        seq.output_token_ids.append(tok)
        self._generation_tokens += 1
        if state.metrics.first_token_time is None:
            state.metrics.first_token_time = now
        state.metrics.last_token_time = now
        k = seq.params.logprobs
        if lp is not None and k is not None:
            seq.cumulative_logprob += lp[0]
            if seq.logprobs is None:
                seq.logprobs = []
            # vLLM's {token_id: Logprob}: the top-k ranked 1..k, then the sampled token (whose
            # rank the sampler counted over the whole vocabulary) wins its own key
            entry = {t: Logprob(v, i + 1) for i, (t, v) in enumerate(
                zip(lp_ids[1 : k + 1], lp[1 : k + 1]))}  # type: ignore[index]
            entry[lp_ids[0]] = Logprob(lp[0], rank)  # type: ignore[index]
            seq.logprobs.append(entry)
        grammar = self._grammar_state(seq)  # advanced; a forbidden token fails the request
        stop_str = state.detoks[seq.index].update(seq.output_token_ids)
        reason = self._finish_reason(seq, tok, stop_str)
        if reason is None and grammar is not None and grammar.is_terminated \
                and not seq.params.ignore_eos:
            reason = ("stop", None)  # the grammar took EOS: nothing may follow, min_tokens or not
        if reason is not None:
            if stop_str is None:
                state.detoks[seq.index].flush(seq.output_token_ids)
            seq.finish_reason, seq.stop_reason = reason
            self.scheduler.finish(seq)
            if state.finished:
                state.metrics.finished_time = now

    def _finish_reason(self, seq: Sequence, tok: int, stop_str: str | None
                       ) -> tuple[str, int | str | None] | None:
        p = seq.params
        n_out = len(seq.output_token_ids)
        if stop_str is not None:
            return "stop", stop_str
        if n_out >= p.min_tokens:
            if tok in p.stop_token_ids:  # type: ignore[operator]
                return "stop", tok
            if not p.ignore_eos and tok in self.eos_token_ids:
                return "stop", None
        if n_out >= p.max_tokens or seq.num_tokens >= self.max_model_len:  # type: ignore[operator]
            return "length", None
        return None

    def _make_output(self, state: RequestState) -> RequestOutput:
        outs = [CompletionOutput(index=s.index, text=d.text, token_ids=_known_tokens(s),
                                 cumulative_logprob=s.cumulative_logprob if s.logprobs else None,
                                 logprobs=list(s.logprobs) if s.logprobs else None,
                                 finish_reason=s.finish_reason, stop_reason=s.stop_reason)
                for s, d in zip(state.seqs, state.detoks)]
        cached = max(state.seqs[0].num_cached_tokens, 0)
        finished = state.finished or any(o.finish_reason == "abort" for o in outs)
        if state.best_of is not None:
            outs = select(outs, finished, state.best_of)
        # Complete once the prefill is (never changed after: a recompute skips what is recorded).
        prompt_lps = (state.seqs[0].prompt_logprobs or [None]) \
            if state.params.prompt_logprobs is not None else None  # [None]: a 1-token prompt
        return RequestOutput(state.request_id, state.prompt, state.prompt_token_ids, outs,
                             finished=finished, num_cached_tokens=cached, metrics=state.metrics,
                             prompt_logprobs=prompt_lps, lora_request=state.lora_request)

    # ---- LoRA adapters (vLLM's add_lora / remove_lora / list_loras) ---------------------------
    def add_lora(self, lora_request: Any) -> bool:
        """Read and check an adapter and keep it in host memory; False if already loaded.
        LoRAError (a 400) when it cannot be served; ConfigError without enable_lora."""
        return self._lora_manager().add(lora_request)

    def remove_lora(self, name_or_id: str | int) -> bool:
        """Forget an adapter by name or lora_int_id; False if unknown. LoRAError while
        requests still run on it."""
        busy = {s.lora_name for s in self._all_seqs() if s.lora_name is not None}
        return self._lora_manager().remove(name_or_id, busy)

    def list_loras(self) -> list[Any]:
        """The LoRARequests of every loaded adapter."""
        return self.lora.list() if self.lora is not None else []

    def resident_loras(self) -> list[str]:
        """Names of the adapters held in memory (device slots, then host): what a replica
        publishes to the router."""
        return self.lora.resident() if self.lora is not None else []

    def lora_request(self, name: str) -> Any:
        """The loaded adapter called `name` (LoRANotFoundError: none)."""
        return self._lora_manager().get(name)

    def lora_requests_info(self) -> tuple[list[str], list[str]]:
        """(adapters of running requests, adapters of waiting ones): vLLM's
        vllm:lora_requests_info labels."""
        sch = self.scheduler
        running = {s.lora_name for s in sch.running if s.lora_name is not None}
        waiting = {s.lora_name for s in [*sch.waiting, *sch.swapped] if s.lora_name is not None}
        return sorted(running), sorted(waiting)

    def _lora_manager(self) -> Any:
        if self.lora is None:
            raise ConfigError("LoRA adapters need an engine started with enable_lora=True "
                              "(kvserve serve --enable-lora)")
        return self.lora

    def _all_seqs(self) -> list[Sequence]:
        return [s for state in self.requests.values() for s in state.seqs]

    def _lora_for(self, lora_request: Any) -> str | None:
        if lora_request is None:
            return None
        if self.lora is None:
            raise InvalidRequestError("this request names a LoRA adapter but the engine was "
                                      "started without enable_lora=True", "lora_request")
        self.lora.add(lora_request)
        return lora_request.lora_name

    def _lora_slots(self, sched: SchedulerOutput) -> list[int] | None:
        """Each scheduled seq's adapter slot (-1: base model), loading adapters into slots."""
        if self.lora is None:
            return None
        names = [s.lora_name for s in sched.seqs]
        if not any(n is not None for n in names):
            return None
        slots = self.lora.activate([n for n in names if n is not None],
                                   self.scheduler.running_loras())
        return [slots[n] if n is not None else -1 for n in names]

    # ---- figures ------------------------------------------------------------------------------
    def get_stats(self) -> EngineStats:
        cache, sch = self.kv.make_stats(), self.scheduler
        # Group 0's table: one slot per token position, as with one group (other groups' pages
        # hold other layers of the same positions, or none where a window released them).
        seq_slots = sum(len(self.kv.block_ids(s)) for s in sch.running) * self.block_size
        seq_tokens = sum(s.num_computed_tokens for s in sch.running)
        waste = seq_slots - seq_tokens
        return EngineStats(
            num_running=len(sch.running), num_waiting=len(sch.waiting),
            num_swapped=len(sch.swapped), kv_cache_usage=cache.usage,
            block_size=self.block_size, num_total_blocks=cache.num_total_blocks,
            num_free_blocks=cache.num_free_blocks, num_cached_blocks=cache.num_cached_blocks,
            num_shared_blocks=cache.num_shared_blocks, num_cpu_blocks=cache.num_cpu_blocks,
            num_free_cpu_blocks=cache.num_free_cpu_blocks,
            prefix_cache_queries=cache.prefix_cache_queries,
            prefix_cache_hits=cache.prefix_cache_hits,
            num_preemptions=sch.num_preemptions, num_evictions=cache.num_evictions,
            kv_slots_used=max(cache.allocated_slots - max(waste, 0), 0),
            kv_slots_allocated=cache.allocated_slots, prompt_tokens=self._prompt_tokens,
            generation_tokens=self._generation_tokens, kv_seq_tokens=seq_tokens,
            kv_seq_slots=seq_slots, prefix_cache_host_hits=cache.prefix_cache_host_hits,
            num_host_blocks=cache.num_host_blocks,
            num_host_cached_blocks=cache.num_host_cached_blocks,
            host_blocks_stored=cache.host.stored, host_blocks_restored=cache.host.restored,
            host_blocks_evicted=cache.host.evicted,
            offload_bytes_to_host=self.tiers.bytes_to_host,
            offload_bytes_to_device=self.tiers.bytes_to_device,
            prefix_cache_disk_hits=cache.prefix_cache_disk_hits,
            num_disk_blocks=cache.num_disk_blocks,
            num_disk_cached_blocks=cache.num_disk_cached_blocks,
            disk_blocks_stored=cache.disk.stored, disk_blocks_restored=cache.disk.restored,
            disk_blocks_evicted=cache.disk.evicted, disk_blocks_dropped=cache.disk_blocks_dropped,
            disk_bad_files=cache.disk_bad_files, offload_bytes_to_disk=cache.disk_bytes_written,
            offload_bytes_from_disk=cache.disk_bytes_read)

    def _observe_step(self, sched: SchedulerOutput, seconds: float) -> None:
        """Feed the swap cost model: prefill rate from prefill-heavy steps, copy rate from the
        step's copies (a decode step's time is per sequence, not per token, so it is left out)."""
        if sched.total_tokens >= max(2 * len(sched.seqs), self.block_size):
            self.swap_cost.observe_prefill(sched.total_tokens, seconds)
        self._observe_copies()

    def _observe_copies(self) -> None:
        tp = self.config.tensor_parallel_size
        for t in self.runner.take_copy_timings():
            self.swap_cost.observe_copy(t.num_bytes, t.seconds)
            self.tiers.add(t.kind, t.num_bytes * tp, t.seconds)

    def drain_kv_events(self, media: tuple[str, ...] = ("device",)) -> list[KVEvent]:
        """Prefix-cache changes since the last call: the device pool's (what a tier-unaware
        index holds), and with "host" / "disk" in `media` those tiers' (`KVEvent.medium`).
        Each tier's log is bounded on its own when not drained."""
        events = self.kv.pool.drain_events() if "device" in media else []
        if "host" in media and self.kv.host is not None:
            events += self.kv.host.drain_events()
        if "disk" in media and self.kv.disk is not None:
            events += self.kv.disk.drain_events()
        if self.kv.groups.is_hybrid:  # the router knows the plain hashes (group 0's keys) only
            events = [e for e in (_plain_keys(e) for e in events) if e is not None]
        return events

    def cached_block_hashes(self, medium: str = "device") -> list[str]:
        """Every hash the device pool (or, `medium="host"` / "disk", that tier) holds now."""
        if medium == "host":
            return [h.hex() for h in self.kv.host.lru_hashes()] if self.kv.host else []
        if medium == "disk":
            return [h.hex() for h in self.kv.disk.lru_hashes()] if self.kv.disk else []
        return [h for h in self.kv.pool.cached_hashes() if is_plain_key(h)]

    def drain_block_alloc_seconds(self) -> list[float]:
        return self.kv.take_alloc_seconds()

    def drain_restore_seconds(self) -> list[float]:
        """Durations of the batched host -> device restores since the last call."""
        return self.tiers.take_restore_seconds()

    def reset_prefix_cache(self, reset_running_requests: bool = False) -> bool:
        """Forget every cached prefix block (device, host and disk tiers); False while running
        requests hold blocks, unless `reset_running_requests` preempts them first (they
        recompute), as vLLM's."""
        self._stepper.drain()
        if reset_running_requests:
            self.scheduler.preempt_running()
        if not self.kv.pool.reset_prefix_cache():
            return False
        if self.kv.host is not None:
            self.kv.host.clear()
        if self.kv.disk is not None:
            self.kv.disk.clear()
        return True


def _known_tokens(seq: Sequence) -> list[int]:
    """The seq's output tokens without a trailing placeholder (a token still on the device)."""
    ids = seq.output_token_ids
    return ids[:-1] if ids and ids[-1] == PLACEHOLDER else list(ids)


def _make_lora_manager(config: EngineConfig, runner: ModelRunner) -> Any:
    """The LoRAManager of enable_lora=True (None otherwise)."""
    if not config.enable_lora:
        return None
    from kvserve.lora.manager import LoRAManager

    return LoRAManager(config.lora_config(), runner.load_lora,
                       lambda weights: runner.lora.resolve(weights))


def _plain_keys(event: KVEvent) -> KVEvent | None:
    """The event's plain block hashes (None if it names only other groups' keys)."""
    if event.kind == "cleared":
        return event
    keep = tuple(h for h in event.block_hashes if is_plain_key(h))
    return replace(event, block_hashes=keep) if keep else None


def _disk_tier(config: EngineConfig, setup: EngineSetup, model_path: str) -> DiskTier | None:
    """The KV disk tier (kv_offloading_disk_path), its files named for this model and layout."""
    if not config.kv_offloading_disk_path or not setup.num_host_blocks:
        return None
    shape = (2, setup.kv_groups.page_layers, config.block_size, setup.num_kv_heads,
             setup.head_dim)
    layout = describe_layout(config.model, config.revision, str(setup.kv_dtype), shape,
                             model_path)
    return DiskTier(config.kv_offloading_disk_path,
                    int(config.kv_offloading_disk_size * (1 << 30)),
                    setup.budget.bytes_per_block, layout)


def _chat_ids(tokenizer: Any, text: str) -> list[int]:
    from kvserve.engine.sample.tokenizer import chat_token_ids

    return chat_token_ids(tokenizer, [{"role": "user", "content": text}])


def _replace(params: SamplingParams, **changes: Any) -> SamplingParams:
    """A copy of `params` with some fields changed (SamplingParams is mutable; never alias)."""
    import copy

    new = copy.copy(params)
    for k, v in changes.items():
        setattr(new, k, v)
    return new


def _logits_processors(config: EngineConfig, device: Any) -> Any:
    """vLLM's LLM(logits_processors=[cls | "module:Class" | "pkg.mod.Class"]), or None."""
    if not config.logits_processors:
        return None
    import importlib

    from kvserve.engine.sample.logits_processor import LogitsProcessor, LogitsProcessors

    classes = []
    for item in config.logits_processors:
        if isinstance(item, str):
            module, _, name = item.replace(":", ".").rpartition(".")
            item = getattr(importlib.import_module(module), name)
        if not (isinstance(item, type) and issubclass(item, LogitsProcessor)):
            raise ConfigError(f"logits_processors takes LogitsProcessor subclasses "
                              f"(kvserve.engine.sample.logits_processor), got {item!r}")
        classes.append(item)
    return LogitsProcessors(classes, config, device)
