"""Processor (vLLM v1's input processing): a request as the caller sends it -> a checked
`NewRequest` for the engine core: the prompt tokenized, best_of expanded, max_tokens capped at
the context, the grammar compiled, the adapter read; InvalidRequestError (with `.param`) for a
request the engine can never serve, before the core sees it."""

from __future__ import annotations

import copy
import time
from collections.abc import Callable
from typing import Any

from kvserve.engine.core.engine_core import EngineCore
from kvserve.engine.core.request import NewRequest, TextTracker
from kvserve.engine.errors import InvalidRequestError
from kvserve.engine.prompt_embeds import check_prompt_embeds, embeds_of
from kvserve.engine.sample.best_of import expand
from kvserve.engine.sample.continuation import Continuation
from kvserve.engine.sample.detokenizer import core_makes_text
from kvserve.engine.sample.sampling_params import SamplingParams
from kvserve.engine.sample.tokenizer import prompt_token_ids

# (prompt token ids, params, makes_text) -> a sample's text tracker (engine/output_processor.py)
TextFactory = Callable[[list[int], SamplingParams, bool], TextTracker]


class Processor:
    def __init__(self, core: EngineCore, new_text: TextFactory) -> None:
        self.core = core
        self.new_text = new_text

    def process(self, request_id: str, prompt: str | list[int], params: SamplingParams, *,
                arrival_time: float | None = None, priority: int = 0,
                cache_salt: str | None = None, lora_request: Any = None,
                detokenize: bool = True, continuation: Continuation | None = None
                ) -> NewRequest:
        """The checked request; `detokenize` False: the core's client makes the text, except
        for the requests `core_makes_text` names. `continuation`: output tokens already
        generated for it elsewhere (engine/sample/continuation.py)."""
        core = self.core
        if request_id in core.requests:
            raise InvalidRequestError(f"request id {request_id!r} is already in use", "request_id")
        if priority != 0 and core.config.scheduling_policy != "priority":
            raise InvalidRequestError(
                f"priority {priority} needs the priority scheduling policy "
                "(--scheduling-policy priority); this engine serves first come, first served",
                "priority")
        lora_name = core.loras.name_for(lora_request)
        embeds = self._embeds(prompt, params)
        if embeds is not None:  # placeholder ids: the runner feeds the embeddings instead
            ids = [0] * embeds.shape[0]
        else:
            ids = prompt_token_ids(core.tokenizer, prompt) if isinstance(prompt, str) \
                else list(prompt)
        text_ids = ids if embeds is None else []  # the detokenizer's left context
        makes_text = detokenize or core_makes_text(params)
        params, best_of = expand(params)
        if continuation is not None:
            continuation.check(params, core.vocab_size)
        params = self.check(ids, params)
        grammar = core.grammars.compile(params.constraint) if params.constraint else None
        if continuation is not None and grammar is not None:
            self._check_grammar(grammar, continuation)
        return NewRequest(
            request_id, prompt if isinstance(prompt, str) else None, ids, params,
            arrival_time if arrival_time is not None else time.monotonic(),
            lambda: self.new_text(text_ids, params, makes_text), priority=priority,
            cache_salt=cache_salt, lora_name=lora_name, lora_request=lora_request,
            grammar=grammar, best_of=best_of, makes_text=makes_text, prompt_embeds=embeds,
            continuation=continuation)

    def _check_grammar(self, grammar: Any, continuation: Continuation) -> None:
        """A continuation the request's grammar refuses is a bad request, not a failed one."""
        try:
            self.core.grammars.matcher(grammar).sync(list(continuation.token_ids))
        except ValueError as exc:
            raise InvalidRequestError(f"the continuation does not follow the request's "
                                      f"structured output: {exc}", "continuation") from None

    def _embeds(self, prompt: Any, params: SamplingParams) -> Any:
        """The checked embeddings of an `{"prompt_embeds": tensor}` prompt (None: text or
        token ids); refused unless the engine enables them, or with prompt logprobs (whose
        targets are the prompt's token ids)."""
        embeds = embeds_of(prompt)
        if embeds is None:
            return None
        core = self.core
        embeds = check_prompt_embeds(embeds, core.config.enable_prompt_embeds,
                                     core.hf_config.hidden_size)
        if params.prompt_logprobs is not None:
            raise InvalidRequestError("prompt_logprobs is not supported with prompt_embeds: "
                                      "the prompt has no token ids to score", "prompt_logprobs")
        return embeds

    def check(self, ids: list[int], params: SamplingParams) -> SamplingParams:
        """`params` as the core runs them (max_tokens capped at the context), or
        InvalidRequestError for a prompt or params this engine can never serve."""
        params.verify()  # again: a caller may have changed a field since it was built
        self._check_prompt(ids)
        limit = self.core.max_model_len
        if params.max_tokens is None or len(ids) + params.max_tokens > limit:
            # As vLLM v1's engine: the output stops at the context (finish_reason "length");
            # the server refuses such a request with a 400 before it gets here.
            params = copy.copy(params)  # SamplingParams is mutable: never alias the caller's
            params.max_tokens = limit - len(ids)
        vocab = self.core.vocab_size
        bias = [t for t in params.logit_bias or {} if t >= vocab]
        if bias:
            raise InvalidRequestError(
                f"logit_bias names token ids past the vocabulary ({vocab}): {bias[:5]}",
                "logit_bias")
        seqs = max(params.n, getattr(params, "beam_width", 1))  # a beam group runs them all
        if seqs > self.core.config.max_num_seqs:
            raise InvalidRequestError(
                f"n={seqs} exceeds max_num_seqs {self.core.config.max_num_seqs}", "n")
        self._check_kv_fits(len(ids) + params.max_tokens)  # type: ignore[operator]
        if getattr(params, "beam_width", 1) > 1:
            self._check_beams_fit(len(ids), params.max_tokens, params.beam_width)  # type: ignore
        return params

    def _check_beams_fit(self, prompt: int, max_tokens: int, width: int) -> None:
        """A beam group is admitted and preempted whole: the KV cache must hold its prompt's
        full blocks once and every beam's own blocks when all diverge at the first token."""
        core = self.core
        num_blocks, bs = core.memory_budget.num_blocks, core.block_size
        need = prompt // bs + width * -(-(prompt % bs + max_tokens) // bs)
        if need > num_blocks:
            raise InvalidRequestError(
                f"a beam search of width {width} needs up to {need} KV blocks (the prompt's "
                f"{prompt // bs} shared, then each beam's own) but the whole KV cache holds "
                f"{num_blocks}; lower max_tokens or the width, or give the engine more KV "
                "memory (kv_cache_memory / gpu_memory_utilization)", "max_tokens")

    def _check_prompt(self, ids: list[int]) -> None:
        vocab, limit = self.core.vocab_size, self.core.max_model_len
        if not ids:
            raise InvalidRequestError("the prompt is empty; send at least one token", "prompt")
        if min(ids) < 0 or max(ids) >= vocab:
            raise InvalidRequestError(
                f"prompt token ids must be in [0, {vocab}), got {min(ids)}..{max(ids)}",
                "prompt")
        if len(ids) >= limit:
            raise InvalidRequestError(
                f"the prompt has {len(ids)} tokens but this model's context (max_model_len) is "
                f"{limit}; shorten the prompt or start the engine with a larger max_model_len",
                "prompt")

    def _check_kv_fits(self, tokens: int) -> None:
        """The whole KV cache must hold one request's prompt and output."""
        core = self.core
        num_blocks, block_size = core.memory_budget.num_blocks, core.block_size
        if tokens > num_blocks * block_size:
            raise InvalidRequestError(
                f"this request needs up to {tokens} KV slots but the whole KV cache holds "
                f"{num_blocks * block_size} tokens; lower max_tokens or give the engine more KV "
                "memory (kv_cache_memory / gpu_memory_utilization)", "max_tokens")
        need = core.kv.groups.blocks_for(tokens, block_size,
                                         core.scheduler.config.max_num_batched_tokens)
        if need > num_blocks:  # several groups: pages, not token slots
            raise InvalidRequestError(
                f"this request needs up to {need} KV blocks (pages of "
                f"{core.kv.groups.page_layers} layers) but the whole KV cache holds "
                f"{num_blocks}; lower max_tokens or give the engine more KV memory "
                "(kv_cache_memory / gpu_memory_utilization)", "max_tokens")
