"""LLM: the offline API, identical in shape to vLLM's `LLM(...).generate(...)` / `.chat(...)`."""

from __future__ import annotations

import contextlib
import itertools
from collections.abc import Iterator
from collections.abc import Sequence as Seq
from typing import Any

from tqdm.auto import tqdm

from kvserve.engine.arg_utils import split_vllm_kwargs
from kvserve.engine.beam_llm import beam_search
from kvserve.engine.config import DEFAULT_MODEL, EngineConfig, structured_outputs_backend
from kvserve.engine.engine_core import MULTIPROCESSING_ENV, env_engine_core  # noqa: F401
from kvserve.engine.errors import ConfigError, InvalidRequestError, RequestFailedError
from kvserve.engine.llm_engine import LLMEngine
from kvserve.engine.metrics_reader import Metric, metrics_of
from kvserve.engine.outputs import RequestOutput
from kvserve.engine.sample.beam_search import BeamSearchOutput, BeamSearchParams
from kvserve.engine.sample.sampling_params import SamplingParams
from kvserve.engine.sample.tokenizer import chat_token_ids

PromptType = str | list[int] | dict[str, Any]


class LLM:
    """An engine for offline batched generation.

    >>> llm = LLM(model="smollm2-135m-instruct", max_model_len=4096)
    >>> llm.generate(["Hello"], SamplingParams(max_tokens=8))[0].outputs[0].text
    """

    def __init__(self, model: str = DEFAULT_MODEL, tokenizer: str | None = None,
                 tensor_parallel_size: int = 1, dtype: str = "auto", seed: int = 0,
                 gpu_memory_utilization: float = 0.90, swap_space: float = 4,
                 max_num_seqs: int = 256, max_model_len: int | None = None,
                 block_size: int = 16, enable_prefix_caching: bool = True,
                 kv_cache_dtype: str = "auto", **kwargs: Any) -> None:
        _structured_outputs_kwargs(kwargs)
        kwargs = split_vllm_kwargs(kwargs)  # vLLM arguments with no effect here
        config = EngineConfig.from_kwargs(
            model=model, tokenizer=tokenizer, tensor_parallel_size=tensor_parallel_size,
            dtype=dtype, seed=seed, gpu_memory_utilization=gpu_memory_utilization,
            swap_space=swap_space, max_num_seqs=max_num_seqs, max_model_len=max_model_len,
            block_size=block_size, enable_prefix_caching=enable_prefix_caching,
            kv_cache_dtype=kv_cache_dtype, **kwargs)
        if config.kv_events_config is not None and config.kv_events_config.publishes and \
                env_engine_core(default="thread") == "process":
            raise ConfigError("LLM(kv_events_config=...) publishes from an engine in this "
                              f"process; unset {MULTIPROCESSING_ENV} (the server publishes "
                              "either way)")
        self.llm_engine = make_engine(config)
        self._counter = itertools.count()
        self._kv_events = _kv_events_publisher(config)  # after the engine: it may fail to load

    def shutdown(self) -> None:
        """Stop the engine's tensor-parallel worker processes, and with a KV disk tier write the
        cached blocks there and release its directory (a no-op otherwise)."""
        if self._kv_events is not None:
            self._publish_kv_events()
            self._kv_events.close()
        self.llm_engine.shutdown()

    def get_default_sampling_params(self) -> SamplingParams:
        """SamplingParams with the model's generation_config.json values (as vLLM's)."""
        return SamplingParams(**self.llm_engine.sampling_defaults)

    def get_tokenizer(self) -> Any:
        return self.llm_engine.tokenizer

    def add_lora(self, lora_request: Any) -> bool:
        return self.llm_engine.add_lora(lora_request)

    def remove_lora(self, name_or_id: str | int) -> bool:
        return self.llm_engine.remove_lora(name_or_id)

    def list_loras(self) -> list[Any]:
        return self.llm_engine.list_loras()

    def reset_prefix_cache(self, reset_running_requests: bool = False) -> bool:
        """Forget every cached prefix block (device, host and disk tiers); False while running
        requests still hold blocks (as vLLM)."""
        done = self.llm_engine.reset_prefix_cache(reset_running_requests)
        self._publish_kv_events()
        return done

    def _publish_kv_events(self) -> None:
        """The KV events since the last call to the ZMQ publisher (kv_events_config)."""
        if self._kv_events is not None:
            self._kv_events.publish(self.llm_engine.drain_kv_events(("device", "host")))

    @classmethod
    def from_engine_args(cls, engine_args: Any) -> LLM:
        """vLLM's: an LLM from an EngineArgs (every field by name)."""
        return cls(**vars(engine_args))

    def save_sharded_state(self, path: str, pattern: str | None = None,
                           max_size: int | None = None) -> None:
        """Each tensor-parallel rank writes its shard of the model as safetensors files in
        `path`; copy the model folder's other files there and load it with
        `LLM(path, load_format="sharded_state", tensor_parallel_size=<the same>)`."""
        self.llm_engine.save_sharded_state(path, pattern, max_size)

    def start_profile(self) -> None:
        """Start the torch profiler (vLLM's); the trace goes to profiler_config's
        torch_profiler_dir, else $KVSERVE_TORCH_PROFILER_DIR or $VLLM_TORCH_PROFILER_DIR, at
        stop_profile(). ConfigError when none is set."""
        self.llm_engine.start_profile()

    def stop_profile(self) -> None:
        self.llm_engine.stop_profile()

    def get_metrics(self) -> list[Metric]:
        """The engine's figures as vLLM's metric objects (`.name`, `.value`, `.labels`)."""
        return metrics_of(self.llm_engine.get_stats(), self.llm_engine.model_name)

    def generate(self, prompts: PromptType | Seq[PromptType] | None = None,
                 sampling_params: SamplingParams | Seq[SamplingParams] | None = None,
                 use_tqdm: bool = True, prompt_token_ids: list[list[int]] | None = None,
                 priority: list[int] | None = None,
                 lora_request: Any = None) -> list[RequestOutput]:
        """Generate for every prompt; outputs come back in input order. `priority` (one per
        prompt, lower first) needs `scheduling_policy="priority"`. `lora_request`: a
        LoRARequest for every prompt, or a list of one per prompt (None: the base model)."""
        items = _normalise_prompts(prompts, prompt_token_ids)
        if priority is not None and len(priority) != len(items):
            raise InvalidRequestError(f"got {len(priority)} priorities for {len(items)} prompts",
                                      "priority")
        return self._run(items, sampling_params, use_tqdm, priority, lora_request)

    def beam_search(self, prompts: PromptType | Seq[PromptType], params: BeamSearchParams,
                    lora_request: Any = None, use_tqdm: bool = False,
                    concurrency_limit: int | None = None) -> list[BeamSearchOutput]:
        """vLLM's beam search: the best `params.beam_width` sequences of each prompt (prompt
        tokens included), best first; the beams share their blocks (engine/beam_llm.py).
        `concurrency_limit` is accepted: every prompt's group is scheduled like a request."""
        return beam_search(self, _normalise_prompts(prompts, None), params, lora_request,
                           use_tqdm)

    def chat(self, messages: list[dict[str, Any]] | list[list[dict[str, Any]]],
             sampling_params: SamplingParams | Seq[SamplingParams] | None = None,
             use_tqdm: bool = True, add_generation_prompt: bool = True,
             chat_template: str | None = None, lora_request: Any = None) -> list[RequestOutput]:
        """Apply the model's chat template to one conversation or a list of them."""
        convs = messages if messages and isinstance(messages[0], list) else [messages]
        tok = self.get_tokenizer()
        items: list[tuple[str | None, str | list[int]]] = []
        for conv in convs:
            ids = chat_token_ids(tok, conv, add_generation_prompt, chat_template)  # type: ignore[arg-type]
            items.append((tok.decode(ids), ids))
        return self._run(items, sampling_params, use_tqdm, lora_request=lora_request)

    def _run(self, items: list[tuple[str | None, str | list[int]]],
             sampling_params: SamplingParams | Seq[SamplingParams] | None,
             use_tqdm: bool, priority: list[int] | None = None,
             lora_request: Any = None) -> list[RequestOutput]:
        if sampling_params is None:
            sampling_params = self.get_default_sampling_params()
        params = _per_prompt_params(sampling_params, len(items))
        loras = _per_prompt_loras(lora_request, len(items))
        engine = self.llm_engine
        ids: list[str] = []
        try:
            for k, ((text, prompt), p) in enumerate(zip(items, params)):
                rid = str(next(self._counter))
                engine.add_request(rid, prompt, p, priority=priority[k] if priority else 0,
                                   lora_request=loras[k])
                ids.append(rid)
                if text is not None and not isinstance(prompt, str):
                    engine.requests[rid].prompt = text
            confirm = getattr(engine, "confirm_added", None)  # a core in its own process
            if confirm is not None:
                confirm(ids)
        except Exception:
            engine.abort_request(ids)
            while engine.has_unfinished_requests():  # drain the aborts
                engine.step()
            raise
        return self._drain(ids, use_tqdm)

    def _drain(self, ids: list[str], use_tqdm: bool) -> list[RequestOutput]:
        engine = self.llm_engine
        done: dict[str, RequestOutput] = {}
        bar = tqdm(total=len(ids), desc="Processed prompts", disable=not use_tqdm,
                   dynamic_ncols=True)
        out_tokens = 0
        wanted, failed = set(ids), {}
        core = getattr(engine, "core", None)  # None: a core in its own process (left open)
        with bar, _arrivals_closed(core):
            while engine.has_unfinished_requests():
                failed.update((i, e) for i, e in engine.take_request_errors().items()
                              if i in wanted)
                for out in engine.step():
                    if out.finished:
                        done[out.request_id] = out
                        out_tokens += sum(len(o.token_ids) for o in out.outputs)
                        bar.update(1)
                        elapsed = bar.format_dict["elapsed"] or 1e-9
                        bar.set_postfix_str(f"output {out_tokens / elapsed:.1f} tok/s")
                self._publish_kv_events()
        failed.update((i, e) for i, e in engine.take_request_errors().items() if i in wanted)
        if failed:  # as vLLM's offline API: a failed request raises instead of looking finished
            first = min(failed, key=ids.index)
            raise RequestFailedError(
                f"{len(failed)} of {len(ids)} requests failed; the first (prompt #{ids.index(first)}"
                f"): {failed[first]!r}",
                [None if i in failed else done.get(i) for i in ids]) from failed[first]
        return [done[i] for i in ids]


@contextlib.contextmanager
def _arrivals_closed(core: Any) -> Iterator[None]:
    """While `LLM` drains its requests no other can arrive: the engine core may plan for that
    (EngineCore.arrivals_closed)."""
    if core is None:
        yield
        return
    core.arrivals_closed = True
    try:
        yield
    finally:
        core.arrivals_closed = False


def _kv_events_publisher(config: EngineConfig) -> Any:
    """The ZMQ publisher of vLLM's kv_events_config (None when it asks for none)."""
    from kvserve.engine.kv_events_zmq import ZmqKVEventPublisher

    events = config.kv_events_config
    if events is None or not events.publishes:
        return None
    return ZmqKVEventPublisher(events, config.block_size)


def make_engine(config: EngineConfig) -> Any:
    """The engine of `LLM`: in this process, or with `KVSERVE_ENABLE_MULTIPROCESSING=1` an
    engine core process behind the client the server uses (engine/engine_core/)."""
    if env_engine_core(default="thread") == "process":
        from kvserve.engine.engine_core.mp_engine import MPLLMEngine

        return MPLLMEngine(config)
    return LLMEngine(config)


def _normalise_prompts(prompts: Any, prompt_token_ids: list[list[int]] | None
                       ) -> list[tuple[str | None, str | list[int]]]:
    """(text, prompt) pairs from a string, token ids, {"prompt"|"prompt_token_ids"|"prompt_embeds"}
    dicts or lists."""
    if prompts is None:
        if prompt_token_ids is None:
            raise InvalidRequestError("pass prompts or prompt_token_ids", "prompts")
        return [(None, list(p)) for p in prompt_token_ids]
    if isinstance(prompts, (str, dict)) or (
            isinstance(prompts, list) and prompts and isinstance(prompts[0], int)):
        prompts = [prompts]
    out: list[tuple[str | None, str | list[int]]] = []
    for p in prompts:
        if isinstance(p, str):
            out.append((p, p))
        elif isinstance(p, dict) and "prompt_embeds" in p:  # vLLM's EmbedsPrompt
            out.append((None, {"prompt_embeds": p["prompt_embeds"]}))
        elif isinstance(p, dict) and "prompt_token_ids" in p:
            out.append((p.get("prompt"), list(p["prompt_token_ids"])))
        elif isinstance(p, dict) and "prompt" in p:
            out.append((p["prompt"], p["prompt"]))
        elif isinstance(p, (list, tuple)):
            out.append((None, list(p)))
        else:
            raise InvalidRequestError(f"unsupported prompt type {type(p).__name__}", "prompts")
    return out


def _per_prompt_params(sp: SamplingParams | Seq[SamplingParams] | None, n: int
                       ) -> list[SamplingParams]:
    if sp is None:
        return [SamplingParams() for _ in range(n)]
    if isinstance(sp, SamplingParams):
        return [sp] * n
    sp = list(sp)
    if len(sp) != n:
        raise InvalidRequestError(
            f"got {len(sp)} SamplingParams for {n} prompts; pass one, or one per prompt",
            "sampling_params")
    return sp


def _per_prompt_loras(lora: Any, n: int) -> list[Any]:
    """One LoRARequest (or None) per prompt from one, None, or a list of one per prompt."""
    if lora is None or not isinstance(lora, (list, tuple)):
        return [lora] * n
    if len(lora) != n:
        raise InvalidRequestError(
            f"got {len(lora)} LoRA requests for {n} prompts; pass one, or one per prompt",
            "lora_request")
    return list(lora)


def _structured_outputs_kwargs(kwargs: dict[str, Any]) -> None:
    """vLLM's `structured_outputs_config={"backend": ...}` and older `guided_decoding_backend=`
    -> EngineConfig.structured_outputs_backend (in place)."""
    backend = structured_outputs_backend(kwargs.pop("structured_outputs_config", None),
                                         kwargs.pop("guided_decoding_backend", None))
    if backend is not None:
        kwargs["structured_outputs_backend"] = backend
