"""Output processing on the client side of a core process: step messages -> cumulative
`RequestOutput`s, detokenising each request incrementally and checking its stop strings here, off
the engine core's process. The in-process counterpart, over the core's own request states, is
engine/output_processor.py; both use engine/sample/detokenizer.py."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from kvserve.engine.engine_core.messages import RequestDelta
from kvserve.engine.outputs import CompletionOutput, Logprob, RequestMetrics, RequestOutput
from kvserve.engine.prompt_embeds import embeds_of, prompt_len
from kvserve.engine.sample.continuation import prime
from kvserve.engine.sample.detokenizer import (IncrementalDetokenizer, core_makes_text,
                                               new_detokenizer)


@dataclass
class _Sample:
    detok: IncrementalDetokenizer
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[dict[int, Logprob]] | None = None
    cumulative_logprob: float | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    skip_tokens: int = 0  # a continuation's tokens and text, left out of the outputs
    skip_chars: int = 0


@dataclass
class ClientRequest:
    """One request as its client tracks it (`prompt` is settable: `LLM.chat` names its text)."""

    request_id: str
    prompt: str | None
    params: Any
    whole: bool  # the core makes its text and sends whole outputs
    prompt_token_ids: list[int] | None = field(default_factory=list)  # None: embeddings
    prompt_logprobs: list | None = None
    num_prompt_embeds: int = 0  # rows of a prompt given as embeddings
    samples: dict[int, _Sample] = field(default_factory=dict)
    full: list[CompletionOutput] = field(default_factory=list)
    metrics: RequestMetrics | None = None
    num_cached_tokens: int = 0
    finished: bool = False
    lora_request: Any = None
    continuation: Any = None  # sample/continuation.Continuation: output generated elsewhere
    kv_transfer_params: dict | None = None  # a KV connector's, once finished


class ClientOutputProcessor:
    """Per-request state of the client; `process` turns a step's deltas into outputs."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self.requests: dict[str, ClientRequest] = {}

    def add(self, request_id: str, prompt: str | list[int], params: Any,
            lora_request: Any = None, continuation: Any = None) -> None:
        req = self.requests[request_id] = ClientRequest(
            request_id, prompt if isinstance(prompt, str) else None, params,
            core_makes_text(params), lora_request=lora_request, continuation=continuation)
        if embeds_of(prompt) is not None:  # as vLLM's: no token ids for embeddings
            req.prompt_token_ids, req.num_prompt_embeds = None, prompt_len(prompt)

    def remove(self, request_id: str) -> None:
        self.requests.pop(request_id, None)

    def process(self, deltas: list[RequestDelta]) -> tuple[list[RequestOutput], list[str]]:
        """(outputs of the requests that moved, requests a stop string ended here: the caller
        aborts them in the core). Deltas of requests no longer tracked are dropped."""
        outputs: list[RequestOutput] = []
        stopped: list[str] = []
        now = time.monotonic()
        for delta in deltas:
            req = self.requests.get(delta[0])
            if req is None:
                continue
            if self._apply(req, delta, now):
                stopped.append(req.request_id)
            outputs.append(self._output(req))
            if req.finished:
                del self.requests[req.request_id]
        return outputs, stopped

    def _apply(self, req: ClientRequest, delta: RequestDelta, now: float) -> bool:
        """Fold one delta in (messages.py's tuple); True when a stop string ended the request
        here."""
        _, finished, cached, metrics, outputs, full, prompt_ids, prompt_lps, kvt = delta
        req.kv_transfer_params = kvt
        if prompt_ids is not None:
            req.prompt_token_ids, req.prompt_logprobs = prompt_ids, prompt_lps
        req.metrics = None if metrics is None else RequestMetrics(*metrics)
        req.num_cached_tokens, req.finished = cached, finished
        if full is not None:
            req.full = full
            return False
        stopped = False
        for index, token_ids, logprobs, cumulative, finish_reason, stop_reason in outputs:
            s = req.samples.get(index)
            if s is None:
                s = req.samples[index] = self._sample(req)
            s.token_ids += token_ids
            if logprobs is not None:
                if s.logprobs is None:
                    s.logprobs = []
                s.logprobs += logprobs
            s.cumulative_logprob = cumulative
            stop = s.detok.update(s.token_ids) if token_ids else None
            if stop is not None:
                s.finish_reason, s.stop_reason = "stop", stop
                stopped = True
            elif finish_reason is not None:
                s.finish_reason, s.stop_reason = finish_reason, stop_reason
                s.detok.flush(s.token_ids)
        if stopped and all(s.finish_reason for s in req.samples.values()):
            req.finished = True
            if req.metrics is not None:
                req.metrics.finished_time = now
        return stopped and req.finished

    def _sample(self, req: ClientRequest) -> _Sample:
        """A sample's state; a continuation's starts with its tokens, their text primed."""
        s = _Sample(self._detok(req))
        if req.continuation is not None:
            s.token_ids = list(req.continuation.token_ids)
            s.skip_tokens = len(s.token_ids)
            s.skip_chars = prime(s.detok, s.token_ids)
        return s

    def _detok(self, req: ClientRequest) -> IncrementalDetokenizer:
        p = req.params
        return new_detokenizer(self.tokenizer, req.prompt_token_ids or [], p.skip_special_tokens,
                               p.stop_strings, p.include_stop_str_in_output)

    def _output(self, req: ClientRequest) -> RequestOutput:
        if req.full or req.whole:
            outs = list(req.full)
        else:
            outs = [CompletionOutput(i, s.detok.text[s.skip_chars:],
                                     s.token_ids[s.skip_tokens:], s.cumulative_logprob,
                                     list(s.logprobs) if s.logprobs else None, s.finish_reason,
                                     s.stop_reason)
                    for i, s in sorted(req.samples.items())]
        return RequestOutput(req.request_id, req.prompt, req.prompt_token_ids, outs,
                             finished=req.finished, num_cached_tokens=req.num_cached_tokens,
                             metrics=req.metrics, prompt_logprobs=req.prompt_logprobs,
                             num_prompt_embeds=req.num_prompt_embeds,
                             lora_request=req.lora_request,
                             kv_transfer_params=req.kv_transfer_params)
