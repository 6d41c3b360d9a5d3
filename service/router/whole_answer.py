"""A non-streamed answer assembled by the router from the stream it asked the replicas for.

The router asks for every migratable non-streamed request as a stream (token ids on each chunk,
usage at the end), so that a replica dying mid-generation leaves it the tokens delivered so far
and the rest can be continued on another replica (service/router/migration.py). The client gets
the body the replica would have sent whole: built here, from the client-facing chunks, with the
same response models the replica uses (service/response_models.py). This file does no I/O."""

from __future__ import annotations

import itertools
import json
from dataclasses import dataclass, field
from typing import Any

from kvserve.service.openai_errors import _ERROR_TYPES
from kvserve.service.response_models import (ChatChoice, ChatCompletionResponse,
                                             ChatResponseMessage, CompletionChoice,
                                             CompletionLogProbs, CompletionResponse, UsageInfo)
from kvserve.service.router.migration_state import split_events

_STATUS_OF_TYPE = {kind: status for status, kind in sorted(_ERROR_TYPES.items(), reverse=True)}
_LOGPROB_LISTS = ("text_offset", "token_logprobs", "tokens", "top_logprobs")


@dataclass
class _Choice:
    """One choice's pieces as the chunks deliver them."""

    text: list[str] = field(default_factory=list)
    reasoning: list[str] = field(default_factory=list)
    calls: dict[int, dict[str, Any]] = field(default_factory=dict)  # tool calls by their index
    logprobs: dict[str, list] | None = None  # completions' four lists, or chat's `content`
    token_ids: list[int] = field(default_factory=list)
    prompt_token_ids: list[int] | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


@dataclass
class WholeAnswer:
    """The chunks of one streamed completion or chat completion, and the body they make."""

    chat: bool
    keep_token_ids: bool  # the client asked for return_token_ids
    head: dict[str, Any] | None = None
    choices: dict[int, _Choice] = field(default_factory=dict)
    usage: dict[str, Any] | None = None
    prompt_token_ids: list[int] | None = None  # chat's, on its first chunk
    error: dict[str, Any] | None = None  # an error event ended the stream

    def feed(self, raw: bytes) -> None:
        """Book the client-facing SSE events in `raw` (whole events)."""
        payloads, _ = split_events(raw)
        for payload in payloads:
            if payload != "[DONE]":
                self.add(json.loads(payload))

    def add(self, data: dict[str, Any]) -> None:
        if "error" in data:
            self.error = data
            return
        if self.head is None:
            self.head = {k: data.get(k) for k in ("id", "created", "model")}
        if data.get("usage"):
            self.usage = data["usage"]
        if data.get("prompt_token_ids") is not None:
            self.prompt_token_ids = data["prompt_token_ids"]
        for c in data.get("choices") or []:
            self._add_choice(self.choices.setdefault(int(c.get("index", 0)), _Choice()), c)

    def _add_choice(self, acc: _Choice, c: dict[str, Any]) -> None:
        acc.token_ids += c.get("token_ids") or []
        if c.get("prompt_token_ids") is not None:
            acc.prompt_token_ids = c["prompt_token_ids"]
        acc.finish_reason = c.get("finish_reason") or acc.finish_reason
        acc.stop_reason = c.get("stop_reason") if c.get("stop_reason") is not None \
            else acc.stop_reason
        lp = c.get("logprobs")
        if self.chat:
            delta = c.get("delta") or {}
            acc.text.append(delta.get("content") or "")
            acc.reasoning.append(delta.get("reasoning_content") or "")
            for call in delta.get("tool_calls") or []:
                _add_call(acc.calls, call)
            if isinstance(lp, dict):
                acc.logprobs = acc.logprobs or {"content": []}
                acc.logprobs["content"] += lp.get("content") or []
        else:
            acc.text.append(c.get("text") or "")
            if isinstance(lp, dict):
                acc.logprobs = acc.logprobs or {k: [] for k in _LOGPROB_LISTS}
                for key in _LOGPROB_LISTS:
                    acc.logprobs[key] += lp.get(key) or []

    def status(self) -> int:
        """The HTTP status of the error that ended the stream (502 when its type says none)."""
        kind = ((self.error or {}).get("error") or {}).get("type")
        return _STATUS_OF_TYPE.get(kind, 502)

    def body(self) -> dict[str, Any]:
        """The non-streamed response body, as the replica would have answered it."""
        head = self.head or {}
        usage = UsageInfo(**self.usage) if self.usage else None
        order = sorted(self.choices)
        if self.chat:
            resp: Any = ChatCompletionResponse(
                id=head.get("id"), created=head.get("created"), model=head.get("model"),
                usage=usage, choices=[self._chat_choice(i) for i in order])
        else:
            resp = CompletionResponse(
                id=head.get("id"), created=head.get("created"), model=head.get("model"),
                usage=usage, choices=[self._completion_choice(i) for i in order])
        body = resp.model_dump()
        if self.keep_token_ids:
            if self.chat:
                body["prompt_token_ids"] = self.prompt_token_ids
            for choice, i in zip(body["choices"], order):
                choice["token_ids"] = self.choices[i].token_ids
                if not self.chat:
                    choice["prompt_token_ids"] = self.choices[i].prompt_token_ids
        return body

    def _completion_choice(self, i: int) -> CompletionChoice:
        c = self.choices[i]
        lp = None
        if c.logprobs is not None:
            # A whole answer counts offsets over its tokens' texts; a stream's chunks count
            # them from the text delivered before (bytes of a split character differ).
            offsets = list(itertools.accumulate((len(t) for t in c.logprobs["tokens"]),
                                                initial=0))[:-1]
            lp = CompletionLogProbs(**{**c.logprobs, "text_offset": offsets})
        return CompletionChoice(index=i, text="".join(c.text), logprobs=lp,
                                finish_reason=c.finish_reason, stop_reason=c.stop_reason)

    def _chat_choice(self, i: int) -> ChatChoice:
        c = self.choices[i]
        reasoning = "".join(c.reasoning) or None
        calls = [c.calls[k] for k in sorted(c.calls)] or None
        # the replica writes no content (null) where a parser took the whole text away
        content = "".join(c.text) or (None if reasoning or calls else "")
        message = ChatResponseMessage(content=content, reasoning_content=reasoning,
                                      reasoning=reasoning, tool_calls=calls)
        return ChatChoice(index=i, message=message, logprobs=c.logprobs,
                          finish_reason=c.finish_reason, stop_reason=c.stop_reason)


def _add_call(calls: dict[int, dict[str, Any]], delta: dict[str, Any]) -> None:
    """Fold one streamed tool-call fragment into the call of its index."""
    call = calls.setdefault(int(delta.get("index", len(calls))),
                            {"id": None, "type": "function",
                             "function": {"name": "", "arguments": ""}})
    if delta.get("id"):
        call["id"] = delta["id"]
    if delta.get("type"):
        call["type"] = delta["type"]
    fn = delta.get("function") or {}
    call["function"]["name"] += fn.get("name") or ""
    call["function"]["arguments"] += fn.get("arguments") or ""
