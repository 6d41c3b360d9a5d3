"""The HTTP side of a simulated fleet: ONE raw ASGI app serving every replica under its own
path prefix (`/r<i>/v1/completions`, `/r<i>/health`, ...); a replica's URL is
`http://host:port/r<i>` and the router joins URL + path as for any replica.

It answers what the router and OpenAI clients call: `POST /v1/completions` and
`/v1/chat/completions` (whole or streamed as server-sent events), `GET /health`, `/v1/models`,
and vLLM's `POST /v1/load_lora_adapter` / `unload_lora_adapter`; `model` selects a resident
adapter, and a name that is neither the model nor a resident adapter gets vLLM's 404.
Prompts are token ids, or text / chat messages tokenized by the router's own function
(service/router/prompt_tokens.py) with the fleet's tokenizer, so the sim hashes exactly the ids
the router hashes. Raw ASGI rather than FastAPI: at hundreds of requests a second on two cores
the framework's per-request cost would be the bottleneck, not the simulated GPUs.
"""

from __future__ import annotations

import itertools
import json
import time
from collections.abc import Awaitable, Callable
from typing import Any

from kvserve.service.sim.replica import (AdapterNotFoundError, CapacityError, SimReplica,
                                         SimRequest)

Send = Callable[[dict], Awaitable[None]]
_ids = itertools.count()


class SimFleetApp:
    """ASGI app over `replicas` (index = the number in the path prefix)."""

    def __init__(self, replicas: list[SimReplica], model: str, tokenizer: Any = None) -> None:
        self.replicas, self.model, self.tokenizer = replicas, model, tokenizer
        self._chat_encoder: Any = None

    async def __call__(self, scope: dict, receive: Callable, send: Send) -> None:
        if scope["type"] != "http":
            return
        replica, path = self._replica_of(scope["path"])
        if replica is None:
            return await _json(send, 404, _error(f"no simulated replica at {scope['path']}"))
        method = scope["method"]
        if method == "GET" and path == "/health":
            return await _json(send, 200, {"status": "ok"})
        if method == "GET" and path == "/v1/models":
            return await _json(send, 200, {"object": "list", "data": [
                {"id": self.model, "object": "model", "owned_by": "kvserve-sim"},
                *({"id": name, "object": "model", "owned_by": "kvserve-sim", "root": root,
                   "parent": self.model} for name, root in replica.adapters.items())]})
        if method == "POST" and path in ("/v1/completions", "/v1/chat/completions"):
            body = await _read_body(receive)
            return await self._generate(replica, path, body, send)
        if method == "POST" and path in ("/v1/load_lora_adapter", "/v1/unload_lora_adapter"):
            return await self._adapter_call(replica, path, await _read_body(receive), send)
        return await _json(send, 404, _error(f"{method} {path} is not simulated"))

    def _replica_of(self, path: str) -> tuple[SimReplica | None, str]:
        head, _, rest = path.lstrip("/").partition("/")
        if not head.startswith("r") or not head[1:].isdigit():
            return None, path
        i = int(head[1:])
        return (self.replicas[i] if i < len(self.replicas) else None), "/" + rest

    async def _adapter_call(self, replica: SimReplica, path: str, raw: bytes,
                            send: Send) -> None:
        """vLLM's answers: 200 with a text, 400 for a bad body or a second load, 404 to unload
        an adapter that is not there."""
        try:
            body = json.loads(raw)
            name = body["lora_name"]
            lora_path = body["lora_path"] if path.startswith("/v1/load") else ""
            if not isinstance(name, str) or not name or not isinstance(lora_path, str):
                raise ValueError
        except (ValueError, TypeError, KeyError):
            return await _json(send, 400, _error("send lora_name (and lora_path to load)"))
        if path == "/v1/unload_lora_adapter":
            try:
                replica.unload_adapter(name)
            except AdapterNotFoundError:
                return await _json(send, 404, _not_found(f"The lora adapter '{name}' cannot "
                                                         "be found."))
            return await _text(send, f"Success: LoRA adapter '{name}' removed successfully.")
        if not await replica.load_adapter(name, lora_path):
            return await _json(send, 400, _error(f"The lora adapter '{name}' has already been "
                                                 "loaded."))
        return await _text(send, f"Success: LoRA adapter '{name}' added successfully.")

    def _lora_of(self, replica: SimReplica, model: Any) -> str | None:
        """The adapter `model` names (None: the base model); AdapterNotFoundError otherwise."""
        if model is None or model == self.model:
            return None
        if isinstance(model, str) and model in replica.adapters:
            return model
        raise AdapterNotFoundError(model)

    async def _generate(self, replica: SimReplica, path: str, raw: bytes, send: Send) -> None:
        try:
            body = json.loads(raw)
            lora = self._lora_of(replica, body.get("model"))
            prompt = self._prompt_tokens(path, body)
            max_tokens = body.get("max_tokens", body.get("max_completion_tokens"))
            max_tokens = 16 if max_tokens is None else int(max_tokens)
            if max_tokens < 1:
                raise ValueError("max_tokens must be at least 1")
            req = replica.submit(f"sim-{next(_ids)}", prompt, max_tokens, body.get("cache_salt"),
                                 lora)
        except AdapterNotFoundError as exc:
            return await _json(send, 404, _not_found(f"The model `{exc.args[0]}` does not "
                                                     "exist."))
        except (ValueError, TypeError, KeyError, AttributeError, CapacityError) as exc:
            return await _json(send, 400, _error(str(exc)))
        chat = path.endswith("/chat/completions")
        try:
            if body.get("stream"):
                await _stream(send, req, self.model, chat, body.get("stream_options") or {})
            else:
                await _whole(send, req, self.model, chat)
        finally:  # the client left (a send failed, the task was cancelled): free its blocks
            if not req.finished:
                replica.abort(req)

    def _prompt_tokens(self, path: str, body: dict) -> list[int]:
        prompt = body.get("prompt")
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], int):
            return [int(t) for t in prompt]
        if self.tokenizer is None:
            raise ValueError("this simulated fleet has no tokenizer: send `prompt` as token ids")
        from kvserve.engine.sample.tokenizer import ChatEncoder
        from kvserve.service.router.prompt_tokens import prompt_tokens_for

        if self._chat_encoder is None:
            self._chat_encoder = ChatEncoder(self.tokenizer)
        tokens = prompt_tokens_for(self.tokenizer, path, body, self._chat_encoder)
        if not tokens:
            raise ValueError("no prompt: send `prompt` (completions) or `messages` (chat)")
        return tokens


async def _read_body(receive: Callable) -> bytes:
    chunks = []
    while True:
        msg = await receive()
        chunks.append(msg.get("body", b""))
        if not msg.get("more_body"):
            return b"".join(chunks)


def _error(message: str, status_type: str = "invalid_request_error") -> dict:
    return {"error": {"message": message, "type": status_type, "param": None, "code": None}}


def _not_found(message: str) -> dict:
    return {"error": {"message": message, "type": "NotFoundError", "param": None, "code": 404}}


async def _text(send: Send, text: str) -> None:
    data = text.encode()
    await send({"type": "http.response.start", "status": 200,
                "headers": [(b"content-type", b"text/plain; charset=utf-8"),
                            (b"content-length", str(len(data)).encode())]})
    await send({"type": "http.response.body", "body": data})


async def _json(send: Send, status: int, payload: dict) -> None:
    data = json.dumps(payload).encode()
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"),
                            (b"content-length", str(len(data)).encode())]})
    await send({"type": "http.response.body", "body": data})


def _usage(req: SimRequest) -> dict:
    return {"prompt_tokens": req.num_prompt_tokens, "completion_tokens": req.num_output_tokens,
            "total_tokens": req.num_prompt_tokens + req.num_output_tokens,
            "prompt_tokens_details": {"cached_tokens": max(req.cached_tokens, 0)}}


def _choice(chat: bool, text: str, finish: str | None, stream: bool) -> dict:
    if not chat:
        return {"index": 0, "text": text, "logprobs": None, "finish_reason": finish}
    key = "delta" if stream else "message"
    return {"index": 0, key: {"role": "assistant", "content": text}, "logprobs": None,
            "finish_reason": finish}


async def _whole(send: Send, req: SimRequest, model: str, chat: bool) -> None:
    n = 0
    while (got := await req.events.get()) is not None:
        n += got
    if req.error:
        return await _json(send, 503, _error(req.error, "service_unavailable"))
    await _json(send, 200, {
        "id": req.seq.request_id, "object": "chat.completion" if chat else "text_completion",
        "created": int(time.time()), "model": model,
        "choices": [_choice(chat, " x" * n, "length", False)], "usage": _usage(req)})


async def _stream(send: Send, req: SimRequest, model: str, chat: bool,
                  options: dict) -> None:
    """Headers at once (as the real server), then one event per burst of tokens: the first token
    at the end of the prefill, then each decode stretch's tokens together."""
    await send({"type": "http.response.start", "status": 200,
                "headers": [(b"content-type", b"text/event-stream"),
                            (b"cache-control", b"no-cache")]})
    obj = "chat.completion.chunk" if chat else "text_completion"
    base = {"id": req.seq.request_id, "object": obj, "created": int(time.time()), "model": model}
    sent = 0
    while (got := await req.events.get()) is not None:
        sent += got
        finish = "length" if sent >= req.max_tokens else None
        event = dict(base, choices=[_choice(chat, " x" * got, finish, True)])
        await send({"type": "http.response.body", "body": _sse(event), "more_body": True})
    if req.error:
        await send({"type": "http.response.body", "more_body": True,
                    "body": _sse(_error(req.error, "service_unavailable"))})
    elif options.get("include_usage"):
        await send({"type": "http.response.body", "more_body": True,
                    "body": _sse(dict(base, choices=[], usage=_usage(req)))})
    await send({"type": "http.response.body", "body": b"data: [DONE]\n\n"})


def _sse(payload: dict) -> bytes:
    return b"data: " + json.dumps(payload).encode() + b"\n\n"
