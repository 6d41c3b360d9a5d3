"""The Responses API's answer shapes (OpenAI's /v1/responses), told from a chat completion: a
finished chat choice becomes a Response object, a chat stream's chunks become the Responses
stream's typed events (output items, text and argument deltas, every event numbered). The
replica's /v1/responses (service/server/responses.py) and the router's migration of Responses
requests (service/router/migration.py) both tell them here, so the two read alike."""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

from kvserve.service.responses_request import ResponsesRequest


def response_base(req: ResponsesRequest) -> dict[str, Any]:
    """A Response object in progress: the request's settings, no output yet."""
    return {"id": f"resp_{uuid.uuid4().hex}", "object": "response",
            "created_at": int(time.time()), "status": "in_progress", "model": req.model,
            "output": [], "error": None, "incomplete_details": None,
            "instructions": req.instructions, "tools": req.tools or [],
            "tool_choice": req.tool_choice or "auto", "parallel_tool_calls": req.parallel_tool_calls,
            "temperature": req.temperature, "top_p": req.top_p,
            "max_output_tokens": req.max_output_tokens, "metadata": req.metadata or {},
            "text": req.text or {"format": {"type": "text"}}, "truncation": "disabled",
            "usage": None}


def finished_response(base: dict[str, Any], choice: dict[str, Any], usage: Any
                      ) -> dict[str, Any]:
    """The Response object of a finished chat choice (a non-streamed chat completion's)."""
    message = choice["message"]
    output = []
    if message.get("reasoning_content"):  # --reasoning-parser's part
        output.append(_reasoning_item(f"rs_{uuid.uuid4().hex}", message["reasoning_content"],
                                      "completed"))
    if message.get("content"):
        output.append(_message_item(f"msg_{uuid.uuid4().hex}", message["content"], "completed"))
    for call in message.get("tool_calls") or []:
        output.append(_call_item(call["id"], call["function"]["name"],
                                 call["function"]["arguments"], "completed"))
    return _close(base, output, choice.get("finish_reason"), usage)


def _close(base: dict[str, Any], output: list, reason: str | None, usage: Any) -> dict[str, Any]:
    cut = reason == "length"
    return {**base, "status": "incomplete" if cut else "completed", "output": output,
            "incomplete_details": {"reason": "max_output_tokens"} if cut else None,
            "usage": _usage(usage)}


def _usage(usage: dict[str, Any] | None) -> dict[str, Any] | None:
    if not usage:
        return None
    cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
    return {"input_tokens": usage["prompt_tokens"], "output_tokens": usage["completion_tokens"],
            "total_tokens": usage["total_tokens"],
            "input_tokens_details": {"cached_tokens": cached},
            "output_tokens_details": {"reasoning_tokens": 0}}


def _message_item(item_id: str, text: str, status: str) -> dict[str, Any]:
    return {"type": "message", "id": item_id, "status": status, "role": "assistant",
            "content": [{"type": "output_text", "text": text, "annotations": []}]
            if status == "completed" else []}


def _reasoning_item(item_id: str, text: str, status: str) -> dict[str, Any]:
    return {"type": "reasoning", "id": item_id, "status": status, "summary": [],
            "content": [{"type": "reasoning_text", "text": text}] if status == "completed"
            else []}


def _call_item(call_id: str, name: str, arguments: str, status: str) -> dict[str, Any]:
    return {"type": "function_call", "id": f"fc_{call_id.removeprefix('call_')}",
            "call_id": call_id, "name": name, "arguments": arguments, "status": status}


class _Retold:
    """The Responses stream's events for one chat stream: output items opened and closed in
    order (the message's text first, then each function call), every event numbered."""

    def __init__(self, base: dict[str, Any]) -> None:
        self.base, self.seq, self.output = base, 0, []
        self.open: dict[str, Any] | None = None  # the item still being written
        self.text = ""

    def event(self, kind: str, **fields: Any) -> str:
        data = {"type": kind, "sequence_number": self.seq, **fields}
        self.seq += 1
        return f"event: {kind}\ndata: {json.dumps(data)}\n\n"

    def reasoning(self, delta: str, ids: list[int] | None = None) -> list[str]:
        out = []
        if self.open is None or self.open["type"] != "reasoning":
            out += self.close()
            self.open, self.text = _reasoning_item(f"rs_{uuid.uuid4().hex}", "", "in_progress"), ""
            out.append(self._added())
        self.text += delta
        out.append(self.event("response.reasoning_text.delta", **self._at(), content_index=0,
                              delta=delta, **_ids(ids)))
        return out

    def content(self, delta: str, ids: list[int] | None = None) -> list[str]:
        out = []
        if self.open is None or self.open["type"] != "message":
            out += self.close()
            self.open, self.text = _message_item(f"msg_{uuid.uuid4().hex}", "", "in_progress"), ""
            out.append(self._added())
            out.append(self.event("response.content_part.added", **self._at(), content_index=0,
                                  part={"type": "output_text", "text": "", "annotations": []}))
        self.text += delta
        out.append(self.event("response.output_text.delta", **self._at(), content_index=0,
                              delta=delta, logprobs=[], **_ids(ids)))
        return out

    def call(self, d: dict[str, Any]) -> list[str]:
        out = []
        fn = d.get("function") or {}
        if d.get("id"):  # a new call
            out += self.close()
            self.open = _call_item(d["id"], fn.get("name") or "", "", "in_progress")
            out.append(self._added())
        if fn.get("arguments") and self.open is not None:
            self.open["arguments"] += fn["arguments"]
            out.append(self.event("response.function_call_arguments.delta", **self._at(),
                                  delta=fn["arguments"]))
        return out

    def close(self) -> list[str]:
        item, self.open = self.open, None
        if item is None:
            return []
        out = []
        if item["type"] == "reasoning":
            out.append(self.event("response.reasoning_text.done", item_id=item["id"],
                                  output_index=len(self.output), content_index=0, text=self.text))
            item = {**item, "content": [{"type": "reasoning_text", "text": self.text}]}
        elif item["type"] == "message":
            part = {"type": "output_text", "text": self.text, "annotations": []}
            where = {"item_id": item["id"], "output_index": len(self.output)}
            out.append(self.event("response.output_text.done", **where, content_index=0,
                                  text=self.text, logprobs=[]))
            out.append(self.event("response.content_part.done", **where, content_index=0,
                                  part=part))
            item = {**item, "content": [part]}
        else:
            out.append(self.event("response.function_call_arguments.done", item_id=item["id"],
                                  output_index=len(self.output), name=item["name"],
                                  arguments=item["arguments"]))
        item["status"] = "completed"
        out.append(self.event("response.output_item.done", output_index=len(self.output),
                              item=item))
        self.output.append(item)
        return out

    def _added(self) -> str:
        return self.event("response.output_item.added", output_index=len(self.output),
                          item=dict(self.open or {}))

    def _at(self) -> dict[str, Any]:
        return {"item_id": (self.open or {})["id"], "output_index": len(self.output)}


def _ids(ids: list[int] | None) -> dict[str, Any]:
    """return_token_ids (kvserve's, on the Responses stream): a text delta's token ids."""
    return {} if ids is None else {"token_ids": ids}


async def _chat_chunks(writes: AsyncIterator[Any]) -> AsyncIterator[dict[str, Any]]:
    """The chat stream's chunks as dicts, until [DONE]; one write may hold several events."""
    async for raw in writes:
        text = raw.decode() if isinstance(raw, bytes) else raw
        for event in text.split("\n\n"):
            payload = event.removeprefix("data: ").strip()
            if payload == "[DONE]":
                return
            if payload:
                yield json.loads(payload)


async def retell_stream(base: dict[str, Any], chunks: AsyncIterator[Any]) -> AsyncIterator[str]:
    """The Responses stream's events for a chat stream's writes (bytes or str of whole events)."""
    told = _Retold(base)
    yield told.event("response.created", response=base)
    yield told.event("response.in_progress", response=base)
    reason, usage = None, None
    async for chunk in _chat_chunks(chunks):
        if "error" in chunk:  # failed mid-stream: say so in-band, as the Responses API does
            err = chunk["error"]
            # A drain's hand-back keeps its mark, for the router to migrate the request.
            handback = {"kvserve_migrate": True} if err.get("kvserve_migrate") else {}
            yield told.event("error", code=err.get("code"), message=err.get("message"),
                             param=err.get("param"), **handback)
            return
        base["model"] = chunk.get("model", base["model"])
        usage = chunk.get("usage") or usage
        for choice in chunk.get("choices", []):
            delta = choice.get("delta") or {}
            ids = choice.get("token_ids")  # return_token_ids: on the delta that carries them
            if delta.get("reasoning_content"):
                for event in told.reasoning(delta["reasoning_content"], ids):
                    yield event
                ids = None
            if delta.get("content"):
                for event in told.content(delta["content"], ids):
                    yield event
            for d in delta.get("tool_calls") or []:
                for event in told.call(d):
                    yield event
            reason = choice.get("finish_reason") or reason
    for event in told.close():
        yield event
    yield told.event("response.completed", response=_close(base, told.output, reason, usage))
