"""LLMEngine: the synchronous engine as users and the server call it (vLLM's `LLMEngine`). A
thin front composing the input processor (engine/processor.py), the engine core
(engine/core/engine_core.py: schedule -> execute -> update) and the output processor
(engine/output_processor.py); LoRA adapters live in kvserve.lora (lora/engine_loras.py).
Not thread-safe by design: one thread (the AsyncEngine's loop, or `LLM.generate`) drives it."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from kvserve.engine.config import EngineConfig
from kvserve.engine.core.core_setup import capture_decode_graphs
from kvserve.engine.core.engine_core import EngineCore
from kvserve.engine.core.kv_events import KVEvent
from kvserve.engine.core.request import RequestState
from kvserve.engine.output_processor import OutputProcessor
from kvserve.engine.outputs import RequestOutput
from kvserve.engine.processor import Processor
from kvserve.engine.sample.continuation import Continuation
from kvserve.engine.sample.generation_config import sampling_defaults
from kvserve.engine.sample.sampling_params import SamplingParams
from kvserve.engine.stats import EngineStats

# The core's parts, read through the front as before the split (tests, benches, the server).
_CORE_ATTRS = ("config", "device", "dtype", "hf_config", "tokenizer", "max_model_len",
               "block_size", "memory_budget", "host_plan", "eos_token_ids", "vocab_size",
               "disk", "kv", "swap_cost", "scheduler", "runner", "tiers", "grammars",
               "requests", "logits_processors", "async_scheduling", "model_weight_bytes")


class LLMEngine:
    def __init__(self, config: EngineConfig, seat: Any = None) -> None:
        # `seat`: the model's place on a KV pool shared by several models (engine/multi_model.py)
        self.core = EngineCore(config, seat)
        self.model_name = config.served_model_name or config.model
        self.output = OutputProcessor(self.core.tokenizer)
        self.processor = Processor(self.core, self.output.new_text)
        # Sampling values a request leaves out (the server and LLM read them; the engine does not).
        self.sampling_defaults = sampling_defaults(self.core.model_path, config.generation_config)
        # False in the engine core process: its client detokenises and checks stop strings,
        # except for the requests `core_makes_text` names.
        self.detokenize = True
        # vLLM's pause_generation(mode="keep"): the requests stay, no step runs until resume.
        self.scheduler_paused = False

    def __getattr__(self, name: str) -> Any:
        if name in _CORE_ATTRS:
            return getattr(self.__dict__["core"], name)
        raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")

    @property
    def lora(self) -> Any:
        """The LoRAManager (None without enable_lora)."""
        return self.core.loras.manager

    @property
    def _stepper(self) -> Any:  # the tests' and benches' look at async scheduling
        return self.core.stepper

    @classmethod
    def from_config(cls, config: EngineConfig) -> LLMEngine:
        return cls(config)

    @classmethod
    def from_engine_args(cls, engine_args: Any) -> LLMEngine:
        """vLLM's constructor: an `EngineArgs` (engine/arg_utils.py) -> its engine."""
        return cls.from_config(engine_args.create_engine_config())

    def _capture_decode_graphs(self, capture: Any = None) -> None:
        """CUDA graphs for decode; `capture`: the CPU tests' stand-in for CUDAGraph."""
        capture_decode_graphs(self.core, capture)

    def check_health(self) -> None:
        """WorkerDiedError when a tensor-parallel worker is gone (even while idle); safe to
        call from another thread (it only looks at the worker processes)."""
        if self.core.runner.workers is not None:
            self.core.runner.workers.check_alive()

    def start_profile(self) -> None:
        """Start the torch profiler around the steps (engine/profiler.py; vLLM's)."""
        self.core.profiler.start()

    def stop_profile(self) -> None:
        self.core.profiler.stop()

    def shutdown(self) -> None:
        """Stop the tensor-parallel workers (nothing to do with one rank); idempotent. Dropping
        the engine or leaving the interpreter stops them too."""
        self.core.shutdown()

    # ---- requests -----------------------------------------------------------------------------
    def add_request(self, request_id: str, prompt: str | list[int], params: SamplingParams, *,
                    arrival_time: float | None = None, priority: int = 0,
                    cache_salt: str | None = None, lora_request: Any = None,
                    continuation: Continuation | None = None) -> None:
        """Queue a request; InvalidRequestError (with `.param`) if it can never be served.
        `prompt`: text, token ids, or `{"prompt_embeds": tensor}` (with enable_prompt_embeds).
        `lora_request` (a LoRARequest): the adapter it runs with, read now if not yet known.
        `continuation`: output tokens already generated elsewhere; the request goes on after
        them and its outputs show only what follows (engine/sample/continuation.py)."""
        self.core.add_request(self.processor.process(
            request_id, prompt, params, arrival_time=arrival_time, priority=priority,
            cache_salt=cache_salt, lora_request=lora_request, detokenize=self.detokenize,
            continuation=continuation))

    def abort_request(self, request_ids: str | Iterable[str]) -> None:
        """Stop requests now; their blocks go back to the pool before this call returns."""
        self.core.abort_requests([request_ids] if isinstance(request_ids, str) else request_ids)

    def take_request_errors(self) -> dict[str, BaseException]:
        """Requests that failed on their own in a step (request id -> the error), since the last
        call. Each was aborted, so its KV blocks are free; the other requests went on."""
        errors, self.core.errors = self.core.errors, {}
        return errors

    def has_unfinished_requests(self) -> bool:
        return bool(self.core.requests) or bool(self.core.pending)

    def has_runnable_requests(self) -> bool:
        """Whether a step would do anything: unfinished requests and the scheduler not paused
        (the engine loops block on their inbox otherwise)."""
        return not self.scheduler_paused and self.has_unfinished_requests()

    def save_sharded_state(self, path: str, pattern: str | None = None,
                           max_size: int | None = None) -> None:
        """Each tensor-parallel rank's shard to `path` (load it with load_format="sharded_state")."""
        self.core.save_sharded_state(path, pattern, max_size)

    @property
    def engine_core(self) -> EngineCore:
        """vLLM's `llm.llm_engine.engine_core` (`.save_sharded_state(path, pattern, max_size)`)."""
        return self.core

    def pause_scheduler(self) -> None:
        """Freeze every request where it is (vLLM's pause "keep" mode): step() does nothing."""
        self.scheduler_paused = True

    def resume_scheduler(self) -> None:
        self.scheduler_paused = False

    def is_scheduler_paused(self) -> bool:
        return self.scheduler_paused

    def get_num_unfinished_requests(self) -> int:
        return len(self.core.requests)

    def step(self) -> list[RequestOutput]:
        """One scheduler iteration and forward pass: the outputs of the requests that moved
        (with async scheduling, those of the step launched by the previous call); none while
        the scheduler is paused."""
        if self.scheduler_paused:
            return []
        return [self.output.make_output(state) for state in self.core.step()]

    def _make_output(self, state: RequestState) -> RequestOutput:
        return self.output.make_output(state)

    # ---- LoRA adapters (vLLM's add_lora / remove_lora / list_loras): lora/engine_loras.py ------
    def add_lora(self, lora_request: Any) -> bool:
        """Read and check an adapter and keep it in host memory; False if already loaded.
        LoRAError (a 400) when it cannot be served; ConfigError without enable_lora."""
        return self.core.loras.add(lora_request)

    def remove_lora(self, name_or_id: str | int) -> bool:
        """Forget an adapter by name or lora_int_id; False if unknown. LoRAError while
        requests still run on it."""
        return self.core.loras.remove(name_or_id, (s.lora_name for s in self.core.all_seqs()
                                                   if s.lora_name is not None))

    def list_loras(self) -> list[Any]:
        """The LoRARequests of every loaded adapter."""
        return self.core.loras.list()

    def resident_loras(self) -> list[str]:
        """Names of the adapters held in memory (device slots, then host): what a replica
        publishes to the router."""
        return self.core.loras.resident()

    def lora_request(self, name: str) -> Any:
        """The loaded adapter called `name` (LoRANotFoundError: none)."""
        return self.core.loras.get(name)

    def lora_requests_info(self) -> tuple[list[str], list[str]]:
        """(adapters of running requests, adapters of waiting ones): vLLM's
        vllm:lora_requests_info labels."""
        sch = self.core.scheduler
        running = {s.lora_name for s in sch.running if s.lora_name is not None}
        waiting = {s.lora_name for s in [*sch.waiting, *sch.swapped] if s.lora_name is not None}
        return sorted(running), sorted(waiting)

    # ---- figures ------------------------------------------------------------------------------
    def get_stats(self) -> EngineStats:
        return self.core.get_stats()

    def drain_kv_events(self, media: tuple[str, ...] = ("device",)) -> list[KVEvent]:
        """Prefix-cache changes since the last call: the device pool's (what a tier-unaware
        index holds), and with "host" / "disk" in `media` those tiers' (`KVEvent.medium`)."""
        return self.core.drain_kv_events(media)

    def cached_block_hashes(self, medium: str = "device") -> list[str]:
        """Every hash the device pool (or, `medium="host"` / "disk", that tier) holds now."""
        return self.core.cached_block_hashes(medium)

    def drain_block_alloc_seconds(self) -> list[float]:
        return self.core.kv.take_alloc_seconds()

    def drain_restore_seconds(self) -> list[float]:
        """Durations of the batched host -> device restores since the last call."""
        return self.core.tiers.take_restore_seconds()

    def reset_prefix_cache(self, reset_running_requests: bool = False) -> bool:
        """Forget every cached prefix block (device, host and disk tiers); False while running
        requests hold blocks, unless `reset_running_requests` preempts them first (they
        recompute), as vLLM's."""
        return self.core.reset_prefix_cache(reset_running_requests)
